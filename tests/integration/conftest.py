"""Fixtures shared by the integration tests: the parity prompts and Hugging Face's greedy
outputs for them (computed once per session, float32, same GGUF weights), and a real Ray
cluster on loopback for the Ray tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.data import parity_texts

MAX_NEW_TOKENS = 64


@pytest.fixture(scope="session")
def tokenizer(default_gguf_path):
    from pagedinfer.tokenizer import Tokenizer

    return Tokenizer.from_model_path(default_gguf_path)


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    """The parity prompts of tests/data: 8 short ones, then 4 long ones of 300-700 tokens."""
    short, long = parity_texts()
    long_ids = [tokenizer.encode(text) for text in long]
    assert len(short) == 8 and len(long_ids) == 4
    assert all(300 < len(ids) <= 700 for ids in long_ids), [len(ids) for ids in long_ids]
    return [tokenizer.encode(text) for text in short] + long_ids


@pytest.fixture(scope="session")
def hf_greedy(default_gguf_path):
    """prompt ids -> Hugging Face transformers' greedy continuation (memoised)."""
    transformers = pytest.importorskip("transformers")
    import torch

    os.environ["HF_HUB_OFFLINE"] = "1"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_gguf_path),
        gguf_file=os.path.basename(default_gguf_path),
        dtype=torch.float32,
    )
    model.eval()
    cache: dict[tuple[int, ...], list[int]] = {}

    def generate(ids: list[int]) -> list[int]:
        key = tuple(ids)
        if key not in cache:
            with torch.inference_mode():
                input_ids = torch.tensor([ids])
                gen = model.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=MAX_NEW_TOKENS,
                    do_sample=False,
                    pad_token_id=model.config.eos_token_id,
                )
            cache[key] = gen[0, len(ids) :].tolist()
        return cache[key]

    return generate


@pytest.fixture(scope="session")
def hf_outputs(prompts, hf_greedy) -> list[list[int]]:
    return [hf_greedy(ids) for ids in prompts]


# Tensor/pipeline parallel tests (test_executors.py, test_ray_executor.py): float32, so the
# sharded engines must equal the single-rank one token for token.
PARALLEL_ENGINE = {"dtype": "float32", "kv_cache_memory_bytes": 64 * 2**20, "max_model_len": 1024}
PARALLEL_MAX_TOKENS = 32


def greedy_token_ids(llm, prompts: list[list[int]], max_tokens: int = PARALLEL_MAX_TOKENS):
    from pagedinfer import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="session")
def single_rank_run(prompts) -> tuple[list[list[int]], int]:
    """The single-rank engine's greedy outputs on `prompts` and its parameter bytes (the
    reference of every parallel configuration; computed once per session)."""
    from pagedinfer import LLM

    with LLM(**PARALLEL_ENGINE) as llm:
        info = llm.llm_engine.engine_core.executor.collective_rpc("rank_info")[0]
        return greedy_token_ids(llm, prompts), info["param_bytes"]


def kill_mid_generation(llm, pid: int, warmup_s: float, max_tokens: int = 2000):
    """Generate in a thread, SIGKILL `pid` (a worker rank) after `warmup_s`, and wait for
    the generate call to fail: (the exceptions it raised, seconds from kill to failure)."""
    import signal
    import threading
    import time

    errors: list[BaseException] = []

    def run() -> None:
        try:
            greedy_token_ids(llm, [[5, 6, 7, 8]] * 4, max_tokens=max_tokens)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(warmup_s)  # mid-generation
    assert thread.is_alive(), "generation ended before the kill"
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=30)
    assert not thread.is_alive(), "generation still running 30 s after the kill"
    return errors, time.monotonic() - killed_at


# Ray tests (test_ray_executor.py, test_data_parallel_ray.py): a cluster of their own.


def process_alive(pid: int) -> bool:
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (field 6 of /proc/PID/stat)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except OSError:  # gone
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def _stop_session(sid: int, timeout_s: float = 15.0) -> list[int]:
    """SIGKILL session `sid`'s processes until none is left; those alive at the end."""
    deadline = time.monotonic() + timeout_s
    while (pids := _session_pids(sid)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    return _session_pids(sid)


@pytest.fixture(scope="module")
def ray_cluster():
    """A head node on 127.0.0.1 with 4 CPUs; RAY_ADDRESS points this process (and the
    processes it starts) at it.

    `ray start` runs in a session of its own, which every daemon and worker of the cluster
    inherits; the teardown kills that session's processes by pid. (Not `ray stop --force`:
    it kills every Ray process on the machine, whoever started it.)"""
    ray = pytest.importorskip("ray")
    from ray._private import ray_constants

    from tests.integration.server_proc import free_port

    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    # Short: Ray's unix socket paths under it must stay below 108 characters.
    temp_dir = tempfile.mkdtemp(prefix="pi-ray-", dir="/tmp")
    address = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # Ray replaces a loopback --node-ip-address with the host's routable IP (and listens
    # there) unless clusters are limited to one machine, a switch meant for macOS and
    # Windows. With it the whole cluster stays on 127.0.0.1.
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    cmd = [
        ray_bin, "start", "--head", "--node-ip-address=127.0.0.1",
        f"--port={address.rsplit(':', 1)[1]}", "--num-cpus=4", "--include-dashboard=false",
        f"--object-store-memory={200 * 2**20}", "--disable-usage-stats", f"--temp-dir={temp_dir}",
    ]  # fmt: skip
    started = time.monotonic()
    # A new session (its id is `ray start`'s pid), inherited by everything the cluster runs.
    proc = subprocess.Popen(
        cmd, env=env, cwd=temp_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=120)
        if proc.returncode != 0:
            pytest.fail(f"`ray start` failed ({proc.returncode}):\n{output}")
        print(f"ray start: {time.monotonic() - started:.1f} s")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RAY_ADDRESS", address)
            mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            # The driver's copy of the switch (read when ray was imported).
            mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
            yield address
    finally:
        # Each Ray user (an executor, a data-parallel client) disconnects on shutdown; still
        # connected means a Ray call came after that, and Ray's auto-init answered it by
        # starting a local cluster.
        stray = ray.is_initialized()
        if stray:
            ray.shutdown()  # stops that local cluster too
        left = _stop_session(proc.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"Ray processes left running: {left}"
        assert not stray, "this process was connected to Ray after every Ray user shut down"


# Data-parallel server tests (test_data_parallel.py, test_data_parallel_ray.py).
DP_MODEL = "SmolLM2-135M-Instruct"
DP_MAX_TOKENS = 16
DP_NUM_PROMPTS = 16


def dp_prompt(i: int) -> str:
    topic = ["rivers", "deserts", "forests", "mountains"][i % 4]
    return f"Question {i}: name one animal that lives in {topic}, and say why."


async def dp_complete(session, base: str, i: int) -> str:
    """One greedy completion of `dp_prompt(i)` from the server at `base`: its text."""
    body = {"model": DP_MODEL, "prompt": dp_prompt(i), "max_tokens": DP_MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    async with session.post(base + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["choices"][0]["text"]


@pytest.fixture(scope="module")
def dp_reference() -> list[str]:
    """Greedy texts of the `dp_prompt`s from one engine core in this process (freed before
    a server starts: the two never load models at the same time)."""
    from pagedinfer import LLM, SamplingParams

    llm = LLM(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=DP_MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([dp_prompt(i) for i in range(DP_NUM_PROMPTS)], params, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].text for o in outs]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url():
    """A real redis-server on loopback, no persistence; its URL. Without a `redis-server`
    binary the test skips, saying so; .ci/run installs it and sets PAGEDINFER_REQUIRE_REDIS=1,
    which turns the skip into a failure."""
    redis = pytest.importorskip("redis", reason="the RedisConnector needs pagedinfer[redis]")

    binary = shutil.which("redis-server")
    if binary is None:
        message = "no redis-server on PATH: `apt-get install redis-server` (.ci/run does)"
        if os.environ.get("PAGEDINFER_REQUIRE_REDIS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
    client.close()
    yield url
    proc.terminate()
    proc.wait(10)
