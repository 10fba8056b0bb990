"""The command line never shows a traceback (issue 17 items 4 and 10): one `streamattn: error: ...` line and a
non-zero code, values checked before the model loads, quiet on a closed pipe, 130 on Ctrl-C."""

import os
import subprocess
import sys

import pytest

from streamattn import cli
from streamattn.text.chat_template import TemplateError

from _model_util import need_smollm2, smollm2_path, write_tiny_gguf


@pytest.fixture
def no_load(monkeypatch):
    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("the model was loaded before the check"))


def one_error_line(capsys, match):
    err = capsys.readouterr().err
    assert err.startswith("streamattn: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert match in err, err


@pytest.mark.parametrize("argv,match", [
    (["-n", "0"], "-n/--max-tokens must be >= 1 (got 0)"),
    (["-n", "-1"], "-n/--max-tokens must be >= 1 (got -1)"),
    (["--backend", "bogus"], "--backend must be one of reference, cpu, gpu, auto (got 'bogus')"),
    (["--window", "8"], "--window 8 applies to --cache window or sinks; with --cache full"),
    (["--cache", "window", "--sinks", "2"], "--sinks 2 applies to --cache sinks"),
    (["--cache", "sinks", "--window", "0"], "--window must be >= 1 (got 0)"),
    (["--prefill-chunk", "1000000"], "--prefill-chunk must be in 1..8192 (got 1000000)"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be in 1..8192 (got 0)"),
    (["--threads", "0"], "--threads must be >= 1 (got 0)"),
    (["--device", "gpu", "--backend", "cpu"], "--backend cpu runs attention on the host, where --device gpu"),
    (["--device", "gpu", "--backend", "reference"], "--backend reference runs attention on the host"),
    (["--device", "cpu", "--backend", "gpu"], "--backend gpu runs attention on the GPU, where --device cpu"),
])
def test_generate_checks_values_before_loading(no_load, capsys, argv, match):
    assert cli.main(["generate", "hello", *argv]) == 2
    one_error_line(capsys, match)
    assert capsys.readouterr().out == ""                       # the prompt was not echoed


def test_backend_gpu_without_a_device(no_load, capsys):
    from streamattn.kv.backends import gpu
    if gpu.available():
        pytest.skip("this machine has a GPU: --backend gpu is valid here")
    assert cli.main(["generate", "hello", "--backend", "gpu"]) == 2
    one_error_line(capsys, "--backend gpu: no CUDA device is visible")


@pytest.mark.parametrize("argv", [["--device", "gpu"], ["--device", "gpu", "--backend", "auto"]])
def test_device_gpu_without_a_device(no_load, capsys, argv):
    from streamattn.kv.backends import gpu
    if gpu.available():
        pytest.skip("this machine has a GPU: --device gpu is valid here")
    assert cli.main(["generate", "hello", *argv]) == 2
    one_error_line(capsys, "--device gpu: no CUDA device is visible (or CuPy is not installed); use --device cpu")
    assert cli.main(["serve", *argv]) == 2
    one_error_line(capsys, "--device gpu: no CUDA device is visible")


@pytest.mark.parametrize("argv,match", [(["--layers", "a,b"], "--layers must be comma-separated layer indices"),
                                        (["--step", "-1"], "--step must be >= 0 (got -1)")])
def test_inspect_checks_values_before_loading(no_load, capsys, argv, match):
    assert cli.main(["inspect", "hello", *argv]) == 2
    one_error_line(capsys, match)


@need_smollm2
def test_inspect_layer_out_of_range(capsys):
    assert cli.main(["inspect", "hello", "-q", "--layers", "99", "--model", smollm2_path()]) == 2
    one_error_line(capsys, "--layers 99: this model has layers 0..29")


def test_a_model_with_zero_heads(tmp_path, capsys):
    path = write_tiny_gguf(tmp_path / "m.gguf", override={"gemma3.attention.head_count": 0})
    assert cli.main(["generate", "hi", "-q", "--model", path]) == 2
    one_error_line(capsys, "'gemma3.attention.head_count' must be an integer in 1..4096 (got int '0')")


@pytest.mark.parametrize("kind", ["file", "unwritable"])
def test_an_unusable_streamattn_home(tmp_path, monkeypatch, capsys, kind):
    home = tmp_path / "home"
    if kind == "file":
        home.write_text("not a folder")
    else:   # chmod does not stop root: the refusal the OS would give
        import pathlib

        def refuse(self, *a, **k):
            raise PermissionError(13, "Permission denied", str(self))
        monkeypatch.setattr(pathlib.Path, "mkdir", refuse)
    monkeypatch.setenv("STREAMATTN_HOME", str(home))
    assert cli.main(["pull", "gemma3-270m"]) == 2
    one_error_line(capsys, "set STREAMATTN_HOME to a writable folder")


@pytest.mark.parametrize("exc,code,err", [
    (TemplateError("chat template: UndefinedError: 'x' is undefined"), 2, "streamattn: error: chat template: "),
    (NotADirectoryError(20, "Not a directory"), 2, "streamattn: error: [Errno 20] Not a directory"),
    (MemoryError(), 3, "streamattn: error: out of memory"),
    (ZeroDivisionError("division by zero"), 1, "streamattn: error: internal error: ZeroDivisionError"),
    (BrokenPipeError(), 141, ""),
])
def test_every_failure_is_one_line(monkeypatch, capsys, exc, code, err):
    def run(args):
        raise exc
    monkeypatch.setitem(cli._COMMANDS, "boom", ("raises", lambda p: None, run))
    monkeypatch.setattr(cli, "_quiet_stdout", lambda: None)        # pytest owns stdout here
    assert cli.main(["boom"]) == code
    got = capsys.readouterr().err
    assert got.startswith(err) and got.count("\n") == (1 if err else 0) and "Traceback" not in got


def test_ctrl_c_finishes_the_line_and_exits_130(monkeypatch, capsys):
    def run(args):
        monkeypatch.setattr(cli, "_OPEN_LINE", True)
        sys.stdout.write("The capital of")
        raise KeyboardInterrupt
    monkeypatch.setitem(cli._COMMANDS, "boom", ("raises", lambda p: None, run))
    assert cli.main(["boom"]) == 130
    out = capsys.readouterr()
    assert out.out == "The capital of\n" and out.err == "streamattn: interrupted\n"


def test_cold_kernel_cache_is_announced_and_warmed_before_timing(monkeypatch, capsys):
    """The notice comes when the attention kernel starts compiling (a fresh function stands in for it),
    and not when it is already compiled or loaded; quiet says nothing either way."""
    from numba import njit
    from streamattn.kv.backends import cpu, warmup

    @njit
    def attend_all(x):
        return x + 1
    calls = []
    monkeypatch.setattr(cpu, "attend_all", attend_all)
    monkeypatch.setattr(warmup, "warm", lambda kind, kind_v=None: calls.append(cpu.attend_all(len(calls))))
    args = cli.build_parser().parse_args(["generate", "x", "--cache-dtype", "float16"])
    cli._warm_kernels(args)
    assert calls == [1] and capsys.readouterr().err.count("compiling attention kernels") == 1
    cli._warm_kernels(args)
    assert calls == [1, 2] and capsys.readouterr().err == ""


def test_notices_say_each_line_once_when_a_compile_starts():
    import io
    from numba import njit
    from streamattn.kv.backends import warmup

    @njit
    def f(x):
        return x * 2

    @njit
    def g(x):
        return f(x) + 1
    out = io.StringIO()
    with warmup.notices({f: "compiling f", g: "compiling g"}, out=out):
        assert g(1) == 3 and g(2) == 5              # g compiles, then f inside it: each said once
        assert g(1.5) == 4.0                         # a new signature of both: nothing said again
    assert out.getvalue() == "compiling g\ncompiling f\n"
    with warmup.notices({f: "compiling f"}, out=out):
        f(3)                                         # compiled already: no compile, no line
    assert out.getvalue() == "compiling g\ncompiling f\n"


@need_smollm2
def test_a_closed_pipe_exits_quietly():
    """`streamattn generate ... | head -c 10`: no BrokenPipeError traceback, nothing on stderr."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run(f"{sys.executable} -m streamattn.cli generate 'Once upon a time' -q -n 40 --model "
                       f"{smollm2_path()} | head -c 10", shell=True, capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.stdout == "Once upon " and p.stderr == "", p.stderr[-2000:]


def test_warm_compiles_or_loads_every_storage_kind():
    from streamattn.kv.backends import warmup
    for kind in ("float32", "float16", "bfloat16"):
        assert warmup.warm(kind) >= 0


def test_a_subcommand_configures_its_own_arguments_alone():
    """``streamattn generate`` parses as with every subcommand configured, and never imports the server's
    or the scale-out's modules (their arguments are theirs); no name configures all (``--help``)."""
    argv = ["generate", "x", "-n", "3", "--cache-dtype", "float16", "--top-p", "0.5"]
    assert vars(cli.build_parser("generate").parse_args(argv)) == vars(cli.build_parser().parse_args(argv))
    with pytest.raises(SystemExit):
        cli.build_parser("generate").parse_args(["serve", "--port", "1"])   # not configured: refused
    code = ("import sys; from streamattn import cli; cli.build_parser('generate').parse_args(['generate', 'x']); "
            "print(sorted(m for m in sys.modules if m.startswith(('streamattn.serve', 'streamattn.scale', "
            "'fastapi', 'ray', 'uvicorn'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("argv,packed,array_layers", [
    ([], True, False), (["--cache", "sinks"], True, True), (["--cache", "window"], True, False),
    (["--weights", "f32"], False, True), ([], False, True)])
def test_generate_warms_the_array_layers_only_where_its_run_takes_them(monkeypatch, tmp_path, argv, packed,
                                                                       array_layers):
    """The array layers (and their attention kernel) are warmed where the run takes them: a sinks cache, or a
    model whose layers the compiled layers cannot bind (float32 matrices, whatever the flags say)."""
    from streamattn.engine import generate
    from streamattn.gguf.loader import load_gguf
    from streamattn.kv.backends import warmup
    from streamattn.models.transformer import Transformer
    from streamattn.quant import matmul as qmatmul
    if packed and not qmatmul.HAVE_KERNELS:
        pytest.skip("the packed kernels need AVX2")
    quant = {n: "Q8_0" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    path = write_tiny_gguf(tmp_path / "m.gguf", arch="llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                           head_dim=16, d_ff=96, quant=quant if packed else None)
    model = Transformer(load_gguf(path, packed_cache=False))
    seen = []
    monkeypatch.setattr(warmup, "warm", lambda kind, kind_v=None: seen.append("attention"))
    monkeypatch.setattr(generate, "warm_model", lambda model, kind, kind_v=None, **kw: seen.append(kw))
    args = cli.build_parser("generate").parse_args(["generate", "x", "-q", *argv])
    cli._warm_kernels(args, model=model)
    assert seen == ["attention"] * array_layers + [{"array_layers": array_layers}]
    seen.clear()
    cli._warm_kernels(args)                                  # no model: the attention kernel alone
    assert seen == ["attention"]


def test_main_has_the_exit_freeze_the_collector_once(monkeypatch, capsys):
    """The collector's objects are frozen at interpreter exit (registered once, whatever main returns)."""
    import atexit
    import gc
    registered = []
    monkeypatch.setattr(cli, "_FREEZE_REGISTERED", False)
    monkeypatch.setattr(atexit, "register", lambda f, *a, **k: registered.append(f))
    assert cli.main(["generate", "x", "-n", "0"]) == 2
    assert cli.main(["generate", "x", "-n", "0"]) == 2
    assert registered == [gc.freeze]
    one_error_line_each = capsys.readouterr().err.count("streamattn: error: -n/--max-tokens must be >= 1")
    assert one_error_line_each == 2
