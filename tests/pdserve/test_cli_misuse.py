"""The `pdserve` command line as a careless user meets it: keys it would silently replace, paths under a file,
seeds out of range, half a key directory, malformed addresses, Ctrl-C while loading. Each is one line naming
the fix and a non-zero exit, before anything starts."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from pdserve.cli import build_parser, main


def one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith(f"pdserve {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_keygen_keeps_existing_keys_unless_forced(tmp_path, capsys):
    keys = tmp_path / "keys"
    assert main(["keygen", str(keys)]) == 0
    before = {path.name: path.read_text() for path in keys.iterdir()}
    assert main(["keygen", str(keys)]) == 2, "keys running processes use are not replaced by a re-run"
    err = one_line_error(capsys, "keygen")
    assert "already holds CURVE keys" in err and "--force" in err and "--if-missing" in err
    assert {path.name: path.read_text() for path in keys.iterdir()} == before
    assert main(["keygen", str(keys), "--force"]) == 0
    assert {path.name: path.read_text() for path in keys.iterdir()} != before


@pytest.mark.parametrize("command", [["keygen"], ["demo-model", "--size", "tiny"]])
def test_an_output_directory_under_a_file_is_one_line(tmp_path, capsys, command):
    (tmp_path / "file").write_text("mine")
    assert main([*command, str(tmp_path / "file" / "sub")]) == 2
    err = one_line_error(capsys, command[0])
    assert str(tmp_path / "file") in err


@pytest.mark.parametrize("command", [["demo-model", "x"], ["generate"], ["bench"], ["plan", "--profile", "p.json"],
                                     ["sweep"]])
@pytest.mark.parametrize("value", ["-1", str(1 << 64), "abc"])
def test_seeds_out_of_range_are_refused_at_parse_time(capsys, command, value):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*command, "--seed", value])
    assert exited.value.code == 2
    assert "argument --seed" in capsys.readouterr().err


def test_ctrl_c_while_working_is_one_line_and_exit_130(monkeypatch, capsys):
    import pdserve.demo_model

    def interrupted(_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(pdserve.demo_model, "run_demo_model_command", interrupted)
    assert main(["demo-model", "anywhere"]) == 130
    err = capsys.readouterr().err
    assert err == "pdserve: interrupted\n"


@pytest.fixture
def half_keys(tmp_path):
    from pdserve.control.keys import write_cluster_keys

    keys = write_cluster_keys(tmp_path / "half")
    (keys / "client.key").unlink()
    return keys


@pytest.mark.parametrize("command", [["prefill"], ["decode"], ["router"], ["up", "--num-kv-blocks", "8"]])
def test_half_a_key_directory_is_refused_before_anything_starts(tmp_path, capsys, half_keys, command):
    extra = ["--log-dir", str(tmp_path / "logs")] if command[0] == "up" else []
    assert main([*command, "--model", str(tmp_path / "no-model"), "--curve-dir", str(half_keys), *extra]) == 2
    err = one_line_error(capsys, command[0])
    assert f"--curve-dir {half_keys}" in err and "client.key" in err and "pdserve keygen DIR" in err


@pytest.mark.parametrize("argv", [
    ["prefill", "--control-address", "garbage"],
    ["decode", "--router-address", "localhost:7000"],
    ["router", "--registration-address", "garbage"],
    ["prefill", "--kv-address", "tcp://127.0.0.1:99999"],
])
def test_a_malformed_address_is_named_as_such(tmp_path, capsys, argv):
    assert main([*argv, "--model", str(tmp_path / "no-model"), "--insecure"]) == 2
    err = one_line_error(capsys, argv[0])
    assert "other machines can reach" not in err, "a malformed address is not a question of trust"
    assert "tcp://" in err and argv[-1] in err


@pytest.mark.parametrize("value", ["0", "-5"])
def test_up_refuses_a_startup_timeout_that_cannot_be_met(tmp_path, capsys, value):
    assert main(["up", "--model", str(tmp_path), "--insecure", "--log-dir", str(tmp_path / "logs"),
                 "--startup-timeout", value]) == 2
    assert "--startup-timeout" in one_line_error(capsys, "up")
    assert not (tmp_path / "logs").exists(), "nothing was started"


@pytest.mark.parametrize("flags, says", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--chat-template", "/nowhere/chat.jinja"], "--chat-template /nowhere/chat.jinja: no such file"),
    (["--chat-template", "{% if %}"], "not a Jinja template"),
    (["--heartbeat-timeout", "-1"], "--heartbeat-timeout: heartbeat timeout -1.0 must be > 0 seconds"),
    (["--heartbeat-timeout", "nan"], "--heartbeat-timeout: heartbeat timeout nan must be > 0"),
    (["--max-concurrent-requests", "0"], "--max-concurrent-requests: max concurrent requests 0 must be a positive"),
    (["--local-prefill-threshold", "-5"], "--local-prefill-threshold: local prefill threshold -5 must be >= 0"),
    (["--request-timeout", "0"], "--request-timeout: request timeout 0.0 must be > 0 seconds"),
    (["--port", "70000"], "--port: port 70000 must be in 0..65535"),
])
def test_up_refuses_what_its_router_would_before_anything_starts(tmp_path, capsys, flags, says):
    """These were refused by the router once `up` had started it: an exit code 1 and a log to read."""
    assert main(["up", "--model", str(tmp_path), "--insecure", "--log-dir", str(tmp_path / "logs"), *flags]) == 2
    assert says in one_line_error(capsys, "up")
    assert not (tmp_path / "logs").exists(), "nothing was started"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU runs --device cuda")
@pytest.mark.parametrize("command", [["up", "--insecure"], ["profile", "--out", "p.json"],
                                     ["sweep", "--configs", "1P1D", "--request-rates", "1"]])
@pytest.mark.parametrize("device", ["cuda", "cuda:1", "tpu"])
def test_a_device_this_machine_lacks_is_refused_before_anything_starts(tmp_path, capsys, monkeypatch, command,
                                                                       device):
    """Was torch's bare AssertionError for `profile`, and a started router and a dead engine for `up` and `sweep`."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert main([command[0], "--model", str(tmp_path), "--device", device, *command[1:]]) == 2
    err = one_line_error(capsys, command[0])
    assert f"device='{device}'" in err and ("--device cpu" in err or "use cpu, cuda or cuda:N" in err)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["config.json"], "nothing was started or written"


@pytest.mark.parametrize("argv, hint", [
    (["up", "--tensor-parallel-size", "2"], "--tensor-parallel-size: pdserve runs each engine on one device: scale "
                                            "out with engines (`pdserve up --num-prefill N --num-decode M`)"),
    (["up", "--gpu-memory-utilization=0.8"], "--gpu-memory-utilization: pdserve sizes the KV cache with "
                                             "--num-kv-blocks"),
    (["up", "--enable-prefix-caching"], "prefix caching is on by default"),
    (["prefill", "--trust-remote-code"], "pdserve runs no code from a model repository"),
    (["decode", "--port", "8001"], "--port: an engine listens on --control-address"),
    (["up", "--context-length", "4096"], "--context-length: pdserve's name for it is --max-model-len"),
    (["up", "Qwen/Qwen2.5-0.5B-Instruct"], "give the model as --model Qwen/Qwen2.5-0.5B-Instruct"),
])
def test_a_vllm_or_sglang_flag_is_refused_naming_what_pdserve_takes(capsys, argv, hint):
    """Was argparse's bare "pdserve: error: unrecognized arguments: ..." under the top-level usage."""
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--insecure"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"pdserve {argv[0]}: error: unrecognized arguments: {' '.join(argv[1:])}" in err and hint in err, err


def test_an_unknown_flag_of_no_other_server_is_refused_as_before(capsys):
    with pytest.raises(SystemExit):
        main(["up", "--bogus", "3"])
    assert capsys.readouterr().err.splitlines()[-1] == "pdserve up: error: unrecognized arguments: --bogus 3"


@pytest.mark.parametrize("command", ["up", "prefill", "decode", "generate"])
@pytest.mark.parametrize("flag", ["--num-kv-blocks", "--block-size", "--max-num-seqs", "--max-num-batched-tokens",
                                  "--max-model-len"])
def test_sizes_below_one_are_refused_at_parse_time(capsys, command, flag):
    """`up` started its router (and waited on it) before the engines refused these; --max-model-len 0 was
    refused as a wire message ("register.max_model_len=0 is out of bounds")."""
    for value in ("0", "-4"):
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args([command, flag, value])
        assert exited.value.code == 2
        assert f"argument {flag}: {value} must be at least 1" in capsys.readouterr().err


def test_vllm_dtype_spellings_mean_what_they_mean_there():
    parser = build_parser()
    assert parser.parse_args(["up", "--dtype", "half"]).dtype == "float16"
    assert parser.parse_args(["decode", "--dtype", "float"]).dtype == "float32"
    assert parser.parse_args(["prefill", "--dtype", "BFloat16"]).dtype == "bfloat16"


def test_a_log_dir_in_use_by_another_up_is_refused(tmp_path, capsys):
    """Two `up` given one --log-dir overwrote each other's logs and shared their engines' progress files."""
    from pdserve.up import lock_log_dir

    logs = tmp_path / "logs"
    logs.mkdir()
    held = lock_log_dir(logs)  # the other `up`
    try:
        assert main(["up", "--model", str(tmp_path / "m"), "--insecure", "--log-dir", str(logs)]) == 2
        err = one_line_error(capsys, "up")
        assert f"--log-dir {logs} is in use by another `pdserve up` (pid {os.getpid()})" in err
        assert not (logs / "router.log").exists(), "nothing was started"
    finally:
        held.close()


def test_insecure_up_says_no_plane_has_curve(tmp_path, capsys, monkeypatch):
    import pdserve.up

    def stop_at_once(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(pdserve.up, "_start_all", stop_at_once)
    # run_up installs its own handlers: the test's come back after
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert main(["up", "--model", str(tmp_path), "--insecure", "--log-dir", str(tmp_path / "logs")]) == 0
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert "[pdserve up] warning: --insecure: no CURVE on any plane" in capsys.readouterr().out
