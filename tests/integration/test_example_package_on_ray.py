"""The README's way to ship an environment package to a Ray cluster: a wheel in the job's
`runtime_env` `py_modules`.

A local Ray instance gets the example package's wheel (examples/reverse-word-env, built as the README
says) in its job-level runtime environment, nowhere else; a task started with the runtime environment
zrl gives its actors (`actor_env`: env_vars, which Ray merges with the job's) finds the environment by
its entry-point name, from the copy Ray installed, and scores a demonstration.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reverse-word-env"


def test_a_wheel_in_py_modules_reaches_the_actors_with_its_entry_point(tmp_path):
    import ray

    from zrl.runtime_env import actor_env

    def probe():  # defined here: Ray pickles it by value (this test module is not importable on a worker)
        import reverse_word_env
        from zrl.env import registry, safe_verify

        info = registry.get("reverse_word")
        env = info.factory()
        [prompt] = env.sample(1, seed=0)
        return info.source, reverse_word_env.__file__, safe_verify(env, prompt, env.demonstration(prompt)).reward

    source = shutil.copytree(EXAMPLE, tmp_path / "src")  # pip's build files stay out of the checkout
    subprocess.run([sys.executable, "-m", "pip", "-q", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("*.whl")
    ray.init(num_cpus=1, include_dashboard=False, runtime_env={"py_modules": [str(wheel)]})
    try:
        task = ray.remote(probe).options(runtime_env={"env_vars": actor_env(1)})
        source_name, module_file, reward = ray.get(task.remote(), timeout=300)
    finally:
        ray.shutdown()
    assert source_name == "entry point zrl-reverse-word-env"
    assert "py_modules_files" in module_file  # the copy Ray installed from the wheel
    assert reward == 1.0
