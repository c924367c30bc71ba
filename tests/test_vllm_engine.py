"""The vLLM engine for real (marked ``vllm``; skipped where no vLLM interpreter is found).

vLLM runs where `find_runtime` finds it: ``$LATTICE_VLLM_PYTHON``, else this interpreter (CI runs these tests
inside the vLLM venv, with this package installed there too). Engines are expensive (a minute or more each on
two cores), so the module starts five: plain decoding and ngram in one worker process, one server, then plain
decoding and one drafter replaying a short trace (`test_traces_replay_through_vllm`).
The model is SmolLM2-135M-Instruct in float32, where vLLM's ngram output equals its plain greedy output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from lattice_inference.engines.sweep import free_port
from lattice_inference.engines.vllm.runtime import find_runtime, vllm_model
from lattice_inference.errors import ConfigError, ModelLoadError
from lattice_inference.options import DecodeOptions
from lattice_inference.prompt_codec import PromptCodec, folder_eos_ids
from lattice_inference.sampling import SamplingOptions

pytestmark = pytest.mark.vllm

try:
    RUNTIME = find_runtime()
    MODEL = vllm_model("smollm2", "float32")
except (ConfigError, ModelLoadError) as exc:
    pytest.skip(f"no vLLM engine to test: {exc}", allow_module_level=True)

openai = pytest.importorskip("openai")

from lattice_inference.engines.vllm.batch import VllmRequest, VllmRun, job_of, outputs_of, run_job  # noqa: E402

DOC = "def clamp(value, low, high):\n    return max(low, min(high, value))\n"
MESSAGES = [
    [{"role": "user", "content": f"Add type hints to this function:\n```python\n{DOC}```"}],
    [{"role": "user", "content": "Copy this line exactly: The quick brown fox jumps over the lazy dog."}],
]
#: Eager mode skips vLLM's torch.compile warm-up (minutes of C++ compilation on a fresh 2-core machine); every
#: engine here runs with it, so the comparisons stay like for like.
ENGINE_ARGS = "--enforce-eager"
SAMPLED = SamplingOptions(temperature=0.8, top_k=50, top_p=0.95, seed=1234)
MAX_NEW = 48


@pytest.fixture(scope="module")
def encoder():
    return PromptCodec.from_folder(MODEL.location)


@pytest.fixture(scope="module")
def prompts(encoder):
    return [encoder.encode_messages(m) for m in MESSAGES]


#: vLLM's own parameters for SAMPLED, written by hand (not by our mapping): the reference.
SAMPLED_BY_HAND = {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "seed": 1234, "max_tokens": MAX_NEW}


@pytest.fixture(scope="module")
def outputs(prompts, encoder):
    """Plain decoding and ngram through our mapping, one engine each: greedy on every prompt; the plain engine
    then gets one seeded sampled request as we map it and as written by hand for vLLM (sampling under ngram:
    see `test_sampling_under_speculation`)."""
    greedy = [VllmRequest(p, MAX_NEW) for p in prompts]
    runs = [
        VllmRun(DecodeOptions(method="greedy"), [*greedy, VllmRequest(prompts[0], MAX_NEW, SAMPLED)]),
        VllmRun(DecodeOptions(method="ngram", max_draft=4), greedy),
    ]
    job = job_of(MODEL, runs, ENGINE_ARGS, RUNTIME.cpu)
    job["runs"][0]["requests"].append({"prompt_token_ids": prompts[0], "sampling": SAMPLED_BY_HAND})
    result = run_job(RUNTIME, job, threads=2)
    plain, ngram = outputs_of(result, folder_eos_ids(MODEL.location, encoder.tokenizer))
    return {"greedy": plain, "ngram": ngram}


def test_ngram_greedy_equals_plain_greedy(outputs, prompts):
    plain, ngram = outputs["greedy"][: len(prompts)], outputs["ngram"][: len(prompts)]
    for p, n in zip(plain, ngram, strict=True):
        assert n.token_ids == p.token_ids and n.text == p.text
        assert len(n.token_ids) > 0
    assert sum(o.spec.get("accepted_tokens", 0) for o in ngram) > 0, "ngram never had a draft accepted"
    assert all(not o.spec.get("drafted_tokens") for o in plain)


def test_seeded_sampling_equals_vllms_own(outputs):
    """The mapped seeded sampling gives exactly what vLLM gives for the same parameters written by hand (plain
    decoding), and it does sample (not greedy's text)."""
    mapped, by_hand = outputs["greedy"][-2:]
    assert mapped.token_ids == by_hand.token_ids and mapped.text == by_hand.text
    assert mapped.token_ids != outputs["greedy"][0].token_ids


def test_sampling_under_speculation(prompts):
    """vLLM's CPU build (0.32) samples wrongly under speculation (uninitialised per-token sampling parameters;
    top-k crashes the engine), so the mapping refuses it there; elsewhere vLLM's rejection sampler is exact in
    distribution only, so nothing is asserted about its text."""
    run = VllmRun(DecodeOptions(method="ngram"), [VllmRequest(prompts[0], MAX_NEW, SAMPLED)])
    if not RUNTIME.cpu:
        pytest.skip("a GPU build: sampling under speculation is vLLM's own business")
    with pytest.raises(ConfigError, match="CPU build samples wrongly"):
        job_of(MODEL, [run], ENGINE_ARGS, RUNTIME.cpu)


@pytest.fixture(scope="module")
def server():
    """``lattice serve --engine vllm --method ngram`` as a user starts it, with an API key."""
    port = free_port()
    cmd = [sys.executable, "-m", "lattice_inference.cli", "serve", "--engine", "vllm", "--method", "ngram",
           "--dtype", "float32", "--threads", "2", "--port", str(port), "--api-key", "sekret",
           f"--engine-args={ENGINE_ARGS}"]  # fmt: skip
    env = dict(os.environ, LATTICE_VLLM_PYTHON=RUNTIME.python)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 1200
    while True:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "vLLM's server did not start"
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5):
                break
        except (urllib.error.URLError, OSError):
            time.sleep(1)
    yield base, proc
    proc.terminate()
    proc.wait(60)


def test_serve_answers_the_openai_client(server, prompts, outputs):
    base, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="sekret", max_retries=0)
    assert [m.id for m in client.models.list()] == ["smollm2"]
    chat = client.chat.completions.create(model="smollm2", messages=MESSAGES[0], max_tokens=MAX_NEW, temperature=0)
    assert chat.choices[0].message.content == outputs["greedy"][0].text
    pieces = client.completions.create(
        model="smollm2", prompt=prompts[1], max_tokens=MAX_NEW, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in pieces if c.choices) == outputs["greedy"][1].text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    request = urllib.request.Request(f"{base}/metrics", headers={"Authorization": "Bearer sekret"})
    with urllib.request.urlopen(request, timeout=30) as r:
        assert "vllm:spec_decode_num_accepted_tokens" in r.read().decode()


def test_serve_stops_vllm_on_exit(server):
    _, proc = server
    found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    children = [int(pid) for pid in found.stdout.split()]
    assert children, "lattice serve --engine vllm runs vLLM's server as its child"
    proc.terminate()
    assert proc.wait(60) == 0
    for pid in children:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()


def test_traces_replay_through_vllm(tmp_path, capfd):
    """``lattice bench --traces --engine vllm``: a two-request trace (the second re-reads the first's document)
    through plain decoding and vLLM's suffix method (where arctic-inference is installed beside vLLM; otherwise
    its ngram), each request with its own budget; the drafter's output is greedy's (float32) and it drafts."""
    from lattice_inference.cli import build_parser
    from lattice_inference.engines.compare import compare

    found = subprocess.run([RUNTIME.python, "-c", "import arctic_inference"], capture_output=True, check=False)
    drafter = "suffix" if found.returncode == 0 else "ngram"
    requests = [{"messages": MESSAGES[0]}, {"messages": MESSAGES[0], "max_new_tokens": MAX_NEW // 2}]
    traces = tmp_path / "traces.jsonl"
    traces.write_text(json.dumps({"id": "re-read", "requests": requests}) + "\n")
    argv = ["bench", "--traces", str(traces), "--engine", "vllm", "--methods", f"greedy,{drafter}", "--json",
            "--dtype", "float32", "--max-new-tokens", str(MAX_NEW), "--threads", "2"]  # fmt: skip
    argv.append(f"--engine-args={ENGINE_ARGS}")
    assert compare(build_parser().parse_args(argv)) == 0
    report = json.loads(capfd.readouterr().out)  # vLLM logs to fd 2
    rows = {r["method"]: r for r in report["batch1"]["vllm"]}
    assert report["traces"] == 1 and rows["greedy"]["runs"] == rows[drafter]["runs"] == 2
    assert rows[drafter]["identical_share"] == 1.0 and rows[drafter]["mean_acceptance_length"] > 1.0
    assert rows["greedy"]["new_tokens"] <= MAX_NEW + MAX_NEW // 2
