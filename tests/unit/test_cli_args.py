"""Every option is checked when the command line is parsed: a bad value is one line naming the option, exit 2,
and no input prints a traceback."""

from __future__ import annotations

import pytest

from meshllm.cli.main import main
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
    (["--model", "m.gguf", "--max-ram", "-1"], "--max-ram"),
    (["--model", "m.gguf", "--max-ram", "nan"], "--max-ram"),
    (["--model", "m.gguf", "--max-vram", "nan"], "--max-vram"),
    (["--model", "m.gguf", "--max-vram", "lots"], "--max-vram"),
    (["--model", "m.gguf", "--ctx-size", "0"], "--ctx-size"),
    (["--model", "m.gguf", "--ctx-size", "4k"], "--ctx-size"),
    (["--model", "m.gguf", "--ctx-size", "100"], "--ctx-size"),
    (["--model", "m.gguf", "--parallel", "0"], "--parallel"),
    (["--model", "m.gguf", "--parallel", "many"], "--parallel"),
    (["--model", "m.gguf", "--parallel", "1000"], "--parallel"),
    (["--model", "m.gguf", "--cache-type", "q5_1"], "--cache-type"),
    (["--model", "m.gguf", "--queue", "-1"], "--queue"),
    (["--model", "m.gguf", "--ubatch-size", "0"], "--ubatch-size"),
    (["--model", "m.gguf", "--chat-template", "no-such-template"], "--chat-template"),
    (["--model", "m.gguf", "--temp", "nan"], "--temp"),
    (["--model", "m.gguf", "--top-p", "2"], "--top-p"),
    (["--model", "m.gguf", "--reasoning-format", "loud"], "--reasoning-format"),
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
    (["--port", "9437", "status"], "--port comes before the subcommand 'status'"),  # was ignored
    # each numeric bound just past its edge (the mutation audit found them untested)
    (["--model", "m.gguf", "--port", "0"], "--port"),
    (["--model", "m.gguf", "--port", "65536"], "--port"),
    (["--model", "m.gguf", "--rpc-port", "65535"], "--rpc-port"),
    (["--model", "m.gguf", "--rpc-port", "0"], "--rpc-port"),
    (["--model", "m.gguf", "--bind-port", "-1"], "--bind-port"),
    (["--model", "m.gguf", "--bind-port", "65536"], "--bind-port"),
    (["--model", "m.gguf", "--max-tokens", "0"], "--max-tokens"),
    (["--model", "m.gguf", "--max-tokens", str((1 << 20) + 1)], "--max-tokens"),
    (["--model", "m.gguf", "--max-vram", "0"], "--max-vram"),
    (["--model", "m.gguf", "--max-vram", "1e6"], "--max-vram"),
    (["--model", "m.gguf", "--max-vram", "nan"], "--max-vram"),
    (["--model", "m.gguf", "--draft-max", "65"], "--draft-max"),
    (["status", "--events", "51"], "--events"),
    (["status", "--events", "-1"], "--events"),
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
        (["--client", "--state-dir", "/nonexistent/mesh-llm-state"], "--client needs --join"),
        (["--join-file", "/nonexistent/token"], "--join-file"),
        (["--client", "--join", "mesh1.x", "--state-dir", "/dev/null/x", "--port", "1"], "state dir /dev/null/x"),
        (["bundle", "/proc/no/such.tar.gz"], "cannot write /proc/no/such.tar.gz"),
        (["--model", "m.gguf", "--cache-type", "q8_0", "--flash-attn", "off"], "--cache-type q8_0 needs flash"),
    ],
)
def test_contradictions_found_before_starting(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_good_values_parse() -> None:
    from meshllm.cli.main import build_parser

    a = build_parser().parse_args(
        ["--model", "m.gguf", "--port", "65535", "--bind-port", "0", "--bind-host", "::", "--advertise",
         "[2001:db8::1]:7000", "--max-vram", "0.5", "--token-ttl", "12h", "--console"]
    )  # fmt: skip
    assert (a.port, a.bind_port, a.bind_host, a.max_vram, a.token_ttl, a.console) == (65535, 0, "::", 0.5, 43200, 3131)
    # --max-ram 0 offers no RAM (the model stays on accelerators); --max-vram 0 is still refused above
    assert build_parser().parse_args(["--model", "m.gguf", "--max-ram", "0"]).max_ram == 0.0


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
    """Item 10: subcommands with a description, every option with help, --model naming all its forms."""
    import argparse

    from meshllm.cli.main import build_parser

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


def test_serving_options_reach_llama_servers_command_line(tmp_path: object) -> None:
    from pathlib import Path

    from meshllm.cli.main import build_parser
    from meshllm.llama.build import Binaries
    from meshllm.llama.chat import BASE_MODEL, TRANSCRIPT, ChatDefault
    from meshllm.llama.processes import Tuning, llama_server_argv
    from meshllm.serve.split.serving_flags import tuning_from

    tpl = Path(str(tmp_path)) / "t.jinja"
    tpl.write_text("{{ messages }}")
    a = build_parser().parse_args(["--model", "m.gguf", "--parallel", "auto", "--ctx-size", "auto", "--cache-type",
                                   "q8_0", "--ubatch-size", "256", "--temp", "0.2", "--chat-template", str(tpl),
                                   "--reasoning-format", "none", "--no-jinja"])  # fmt: skip
    assert (a.parallel, a.ctx_size) == (None, None)
    t = tuning_from(a)
    bins = Binaries(Path("/x/rpc-server"), Path("/x/llama-server"), "user")
    gemma = ChatDefault(builtin="gemma")
    argv = llama_server_argv(bins, Path("m.gguf"), 1, ctx_size=8192, parallel=4, tuning=t, chat=gemma)
    joined = " ".join(argv)
    assert "--ctx-size 32768" in joined and "--parallel 4" in joined and "--cont-batching" in joined
    assert "--cache-type-k q8_0 --cache-type-v q8_0" in joined and "--ubatch-size 256" in joined
    assert f"--chat-template-file {tpl}" in joined and "--chat-template " not in joined  # the user's, not the arch's
    assert "--temp 0.2" in joined and "--reasoning-format none" in joined and "--no-jinja" in joined
    # a model without a template: its architecture's built-in one, with Jinja off (Jinja would read the name as text)
    plain = " ".join(llama_server_argv(bins, Path("m.gguf"), 1, chat=gemma))
    assert "--chat-template gemma --no-jinja" in plain
    chatml = tuning_from(build_parser().parse_args(["--model", "m", "--chat-template", "chatml"]))
    named = " ".join(llama_server_argv(bins, Path("m.gguf"), 1, tuning=chatml, chat=gemma))
    assert "--chat-template chatml --no-jinja" in named
    # a base model: our transcript template (a Jinja file) and its stops, unless the user names a template or
    # turns Jinja off (llama-server reads a file without Jinja as one of its built-ins by name)
    base = " ".join(llama_server_argv(bins, Path("m.gguf"), 1, chat=BASE_MODEL))
    assert base.endswith(f"--chat-template-file {TRANSCRIPT}") and TRANSCRIPT.is_file()  # Jinja: its default
    assert Tuning().default_chat(BASE_MODEL) == BASE_MODEL and Tuning().default_chat(gemma) is None
    assert chatml.default_chat(BASE_MODEL) is None and t.default_chat(BASE_MODEL) is None
    no_jinja = tuning_from(build_parser().parse_args(["--model", "m", "--no-jinja"]))
    assert no_jinja.default_chat(BASE_MODEL) is None
    assert "--chat-template" not in " ".join(llama_server_argv(bins, Path("m.gguf"), 1, tuning=no_jinja,
                                                               chat=BASE_MODEL))  # fmt: skip


def test_a_model_without_a_template_gets_one_that_suits_it() -> None:
    """An instruction-tuned GGUF without a template gets its architecture's built-in one; a base model
    (no fine-tune named) or an architecture without a built-in gets the plain transcript; a GGUF's own wins."""
    from meshllm.llama.chat import BASE_MODEL, ChatDefault, chat_default

    assert chat_default({"general.architecture": "gemma3"}) == BASE_MODEL  # the tiny default model
    assert chat_default({"general.architecture": "gemma3", "general.finetune": "it"}) == ChatDefault(builtin="gemma")
    assert chat_default({"general.architecture": "gemma3", "general.finetune": " "}) == BASE_MODEL
    assert chat_default({"general.architecture": "llama", "general.finetune": "Instruct"}) == BASE_MODEL
    assert chat_default({"general.architecture": "gemma3", "tokenizer.chat_template": "{{ x }}"}) is None


def test_durations_read_as_people_say_them() -> None:
    """`token --ttl 30m` said "valid 0 h"."""
    from meshllm.serve.report.narration import duration

    assert [duration(x) for x in (45, 1800, 5400, 43200, 86400, 129600, 30 * 86400)] == [
        "45 s", "30 min", "1 h 30 min", "12 h", "1 d", "1 d 12 h", "30 d"]  # fmt: skip


def test_a_node_may_be_named_like_a_subcommand() -> None:
    from meshllm.cli.main import _options_before_subcommand, build_parser

    p = build_parser()
    assert _options_before_subcommand(p, ["--model", "m.gguf", "--name", "status"]) == []
    assert _options_before_subcommand(p, ["-v", "status"]) == []
    assert _options_before_subcommand(p, ["--max-vram", "1", "token"]) == ["--max-vram", "1"]


def test_relay_rate_reads_megabytes_per_second() -> None:
    """--relay-rate MB/s (0: no cap); anything else is one line naming the option."""
    import pytest

    from meshllm.cli.main import build_parser
    from meshllm.proto.reach import RELAY_RATE

    assert build_parser().parse_args(["--model", "m"]).relay_rate == RELAY_RATE == 8 * 2**20
    assert build_parser().parse_args(["--model", "m", "--relay-rate", "2.5"]).relay_rate == 2.5 * 2**20
    assert build_parser().parse_args(["--model", "m", "--relay-rate", "0"]).relay_rate == 0
    for bad in ("-1", "fast", "nan"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--model", "m", "--relay-rate", bad])


def test_an_unknown_option_is_named_with_the_one_it_may_be_a_typo_of() -> None:
    """`--modle gemma3-270m` was reported as "invalid choice: 'gemma3-270m'" (argparse read the model's
    name as a subcommand)."""
    from meshllm.cli.main import build_parser, unknown_option

    p = build_parser()
    assert unknown_option(p, ["--modle", "gemma3-270m"]) == "unknown option --modle (did you mean --model?)"
    assert unknown_option(p, ["status", "--jsn"]) == "unknown option --jsn (did you mean --json?)"
    assert unknown_option(p, ["--frobnicate"]) == "unknown option --frobnicate"
    assert unknown_option(p, ["--model", "x", "--max-vram=3", "--", "--anything"]) is None
    assert unknown_option(p, ["service", "install", "--model", "gemma3-270m"]) is None
