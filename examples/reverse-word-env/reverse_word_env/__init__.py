"""An example zrl environment package: `envs.ReverseWord`, registered as `reverse_word` by the
`zrl.environments` entry point in this package's pyproject.toml."""
