"""Every code block in the README runs as pasted, in order, on one repo made by `featurestore init`.

- ``python`` blocks are the repo's definitions, appended to ``features.py`` in order (then
  ``apply`` and ``materialize-incremental`` must pass); ``python script`` blocks run as scripts
  from the repo's folder afterwards;
- ``bash`` blocks: each ``featurestore`` line runs in the repo (``serve`` starts a server the
  ``curl`` lines then call); the two set-up commands are what ``.ci/run`` and a fresh machine run
  (checked against ``.ci/run``, not re-run here);
- ``yaml`` blocks are fragments of ``featurestore.yaml`` the config loader must accept.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from .conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)


def blocks() -> list[tuple[str, str]]:
    return [(info.strip(), body) for info, body in BLOCK.findall((ROOT / "README.md").read_text())]


def test_the_set_up_commands_are_what_ci_runs():
    setup = [body.strip() for info, body in blocks() if info == "bash" and "python3 -m venv" in body]
    assert len(setup) == 2, setup  # one runs the demo, one runs the tests
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(c for c in setup if "pytest" in c)
    assert test_command.split("&& ", 2)[2] in ci  # (the venv is made by .ci/run itself)
    # and the lint, format and type checks the README names (in a sentence, wrapped) are CI's
    lint = re.search(r"`(ruff check[^`]*)`", " ".join((ROOT / "README.md").read_text().split()))
    assert lint is not None and lint.group(1) in ci


def test_every_readme_block_runs_as_pasted(tmp_path, redis_url):
    env = {**os.environ, "REDIS_URL": redis_url, "COLUMNS": "200"}
    repo = tmp_path / "my_repo"

    def run(command: list[str], cwd: Path = repo, timeout: int = 300) -> str:
        out = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env, timeout=timeout)
        assert out.returncode == 0, f"{shlex.join(command)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        return out.stdout

    run([sys.executable, "-m", "featurestore", "init", str(repo), "--project", f"readme{os.getpid()}"], cwd=tmp_path)
    definitions = [body for info, body in blocks() if info == "python"]
    assert definitions, "the README shows no definitions"
    (repo / "features.py").write_text("\n\n".join(definitions))
    run([sys.executable, "-m", "featurestore", "apply"])
    run([sys.executable, "-m", "featurestore", "materialize-incremental"])
    for info, body in blocks():
        if info == "python script":
            script = repo / "readme_script.py"
            script.write_text(body)
            run([sys.executable, str(script)])
        elif info == "yaml":
            fragment = yaml.safe_load(body)
            config = yaml.safe_load((repo / "featurestore.yaml").read_text())
            from featurestore.config import RepoConfig

            (tmp_path / "config_check").mkdir(exist_ok=True)
            (tmp_path / "config_check" / "featurestore.yaml").write_text(yaml.safe_dump({**config, **fragment}))
            RepoConfig.load(tmp_path / "config_check")  # accepted: no unknown or misspelt key
    server = None
    port = free_port()
    try:
        for info, body in blocks():
            if info != "bash" or "python3 -m venv" in body:
                continue
            for line in body.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                if line.startswith("featurestore serve"):
                    args = shlex.split(line.rstrip("&").strip())[1:]
                    server = subprocess.Popen(
                        [sys.executable, "-m", "featurestore", *args, "--port", str(port)],
                        cwd=repo,
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE,
                        text=True,
                    )
                    _wait_for(port, server)
                elif line.startswith("featurestore "):
                    run([sys.executable, "-m", "featurestore", *shlex.split(line)[1:]])
                elif line.startswith("curl "):
                    assert server is not None, f"{line}: no server started before it in the README"
                    out = run(shlex.split(line.replace("localhost:6566", f"localhost:{port}")))
                    assert '"detail"' not in out, out  # an answer, not an error
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)


def _wait_for(port: int, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stderr.read() if server.stderr else ""
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise AssertionError("the server did not start")
