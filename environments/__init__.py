"""Built-in verifiable environments. Each is an ordinary plugin: a `zrl.env.Environment` subclass
registered through the `zrl.environments` entry-point group in pyproject.toml, exactly as a user's
package would register its own."""
