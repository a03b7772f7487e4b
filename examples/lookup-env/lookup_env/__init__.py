"""An example zrl multi-turn environment package: `envs.Lookup`, registered as `lookup` by the
`zrl.environments` entry point in this package's pyproject.toml."""
