"""Every option is checked when the command line is parsed: a bad value is one line naming the option, exit 2,
and no input prints a traceback ([first-run])."""

from __future__ import annotations

import pytest

from meshllm.cli import main
from meshllm.net.endpoint import parse_addr

BAD = [
    (["--model", "m.gguf", "--port", "99999"], "--port"),
    (["--model", "m.gguf", "--port", "0"], "--port"),
    (["--model", "m.gguf", "--port", "http"], "--port"),
    (["--model", "m.gguf", "--bind-port", "-1"], "--bind-port"),
    (["--model", "m.gguf", "--bind-port", "65536"], "--bind-port"),
    (["--model", "m.gguf", "--bind-host", "not-an-ip"], "--bind-host"),
    (["--model", "m.gguf", "--name", "x" * 33], "--name"),
    (["--model", "m.gguf", "--name", "tab\there"], "--name"),
    (["--model", "m.gguf", "--advertise", "1.2.3.4"], "--advertise"),
    (["--model", "m.gguf", "--advertise", "1.2.3.4:70000"], "--advertise"),
    (["--model", "m.gguf", "--relay", ":4000"], "--relay"),
    (["--model", "m.gguf", "--max-vram", "-3"], "--max-vram"),
    (["--model", "m.gguf", "--max-vram", "0"], "--max-vram"),
    (["--model", "m.gguf", "--max-vram", "nan"], "--max-vram"),
    (["--model", "m.gguf", "--max-vram", "lots"], "--max-vram"),
    (["--model", "m.gguf", "--ctx-size", "0"], "--ctx-size"),
    (["--model", "m.gguf", "--ctx-size", "4k"], "--ctx-size"),
    (["--model", "m.gguf", "--token-ttl", "0"], "--token-ttl"),
    (["--model", "m.gguf", "--token-ttl", "forever"], "--token-ttl"),
    (["--model", "m.gguf", "--tensor-split", "1,-1"], "--tensor-split"),
    (["--model", "m.gguf", "--tensor-split", "1,inf"], "--tensor-split"),
    (["--model", "m.gguf", "--console", "70000"], "--console"),
    (["--model", "m.gguf", "--draft-max", "0"], "--draft-max"),
    (["--model", "m.gguf", "--api-key", ""], "--api-key"),
    (["--join", ""], "--join"),
    (["--model", "m.gguf", "--no-such-option"], "--no-such-option"),
    (["build", "-j", "0"], "-j"),
    (["build", "--cpu", "fastest"], "--cpu"),
    (["build", "--backend", "tpu"], "--backend"),
    (["token", "--ttl", "-5"], "--ttl"),
    (["status", "--port", "99999"], "--port"),
    (["bundle", "--python", "2.7"], "--python"),
    (["bundle", "-j", "-1"], "-j"),
    (["download", ""], "name"),
]


@pytest.mark.parametrize(("argv", "option"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_value_is_one_line_naming_the_option(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert option in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--client", "--model", "m.gguf", "--join", "x"], "--client serves no model"),
        (["--client"], "--client needs --join"),
        (["--join-file", "/nonexistent/token"], "--join-file"),
        (["--client", "--join", "mesh1.x", "--state-dir", "/dev/null/x", "--port", "1"], "state dir /dev/null/x"),
        (["bundle", "/proc/no/such.tar.gz"], "cannot write /proc/no/such.tar.gz"),
    ],
)
def test_contradictions_found_before_starting(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_good_values_parse() -> None:
    from meshllm.cli import build_parser

    a = build_parser().parse_args(
        ["--model", "m.gguf", "--port", "65535", "--bind-port", "0", "--bind-host", "::", "--advertise",
         "[2001:db8::1]:7000", "--max-vram", "0.5", "--token-ttl", "12h", "--console"]
    )  # fmt: skip
    assert (a.port, a.bind_port, a.bind_host, a.max_vram, a.token_ttl, a.console) == (65535, 0, "::", 0.5, 43200, 3131)


def test_gossiped_addresses_with_impossible_ports_are_refused() -> None:
    assert parse_addr("127.0.0.1:7000") == ("127.0.0.1", 7000)
    for bad in ("127.0.0.1:70000", "127.0.0.1:0", "127.0.0.1:", "[::1]:99999"):
        with pytest.raises(ValueError):
            parse_addr(bad)


def test_a_bad_token_is_the_users_error_only_at_the_users_boundary() -> None:
    from meshllm.errors import UserError
    from meshllm.proto import token as tok
    from meshllm.serve.options import parse_tokens

    assert not issubclass(tok.TokenError, UserError)  # a peer's bad token is refused where it arrives, not ours
    with pytest.raises(UserError, match="invite token malformed") as e:
        parse_tokens(["mesh1.not-a-token"], 0.0, None)
    assert "\n" not in str(e.value)


def test_every_command_and_option_explains_itself() -> None:
    """[face] item 10: subcommands with a description, every option with help, --model naming all its forms."""
    import argparse

    from meshllm.cli import build_parser

    p = build_parser()
    subs = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in [("mesh-llm", p), *subs.choices.items()]:
        assert name == "mesh-llm" or sp.description, f"{name}: no description"
        for a in sp._actions:
            if a.option_strings and a.dest not in ("help", "version"):
                assert a.help, f"{name} {a.option_strings[0]}: no help"
    model = next(a for a in p._actions if "--model" in a.option_strings)
    assert model.help is not None
    assert all(w in model.help for w in ("catalog", "org/repo/file.gguf", "https://")), model.help
