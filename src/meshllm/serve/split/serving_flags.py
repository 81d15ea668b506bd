"""The command line's serving options: slots, context, KV cache, and the llama-server options a llama-server user
expects (batch sizes, chat template, rope scaling, reasoning format, sampling defaults). Each is checked when the
command line is parsed (one clear line for a bad value); the host applies them (``llama.processes.Tuning``)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

from meshllm.errors import UserError
from meshllm.llama.processes import BUILTIN_TEMPLATES, Tuning
from meshllm.proto.sizing import CACHE_TYPES, MAX_AUTO_SLOTS

MAX_SLOTS = 256
# sampling defaults: flag -> (lowest, highest) value a request that does not say gets
SAMPLING = {"--temp": (0.0, 10.0), "--top-p": (0.0, 1.0), "--top-k": (0, 1 << 20), "--min-p": (0.0, 1.0),
            "--repeat-penalty": (0.0, 10.0), "--presence-penalty": (-2.0, 2.0), "--frequency-penalty": (-2.0, 2.0),
            "--seed": (-1, 2**32 - 1)}  # fmt: skip


def int_in(text: str, lo: int, hi: int, what: str) -> int:
    """A whole number in [lo, hi], or one line naming ``what`` (the command line's integer check)."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"{what} must be {lo}-{hi}, got {value}")
    return value


def _count(lo: int, hi: int, what: str) -> Callable[[str], int]:
    return lambda text: int_in(text, lo, hi, what)


def _auto_or(lo: int, hi: int, what: str) -> Callable[[str], int | None]:
    """A whole number in [lo, hi], or "auto" (None)."""
    return lambda text: None if text == "auto" else int_in(text, lo, hi, f"{what} (or auto)")


def chat_template(text: str) -> str:
    if text in BUILTIN_TEMPLATES or Path(text).is_file():
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is neither a Jinja template file nor one of llama.cpp's built-in templates "
        f"({', '.join(sorted(BUILTIN_TEMPLATES))})"
    )


def _sampling_value(flag: str) -> Callable[[str], str]:
    lo, hi = SAMPLING[flag]

    def parse(text: str) -> str:
        try:
            value = float(text) if isinstance(lo, float) else int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: {text!r} is not a number") from None
        if not (math.isfinite(value) and lo <= value <= hi):
            raise argparse.ArgumentTypeError(f"{flag} must be {lo}-{hi}, got {text}")
        return text

    return parse


def add_serving_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serving (the host applies these to llama-server)")
    g.add_argument("--parallel", type=_auto_or(1, MAX_SLOTS, "--parallel"), default=None, metavar="N|auto",
                   help=f"requests served at once (slots, continuous batching); auto (default): the most, up to "
                        f"{MAX_AUTO_SLOTS}, whose KV cache fits the nodes the model needs")  # fmt: skip
    g.add_argument("--ctx-size", type=_auto_or(256, 1 << 24, "--ctx-size"), default=None, metavar="N|auto",
                   help="context of each slot, in tokens; auto (default): the most that fits, up to the model's "
                        "trained context")  # fmt: skip
    g.add_argument(
        "--cache-type",
        choices=sorted(CACHE_TYPES),
        default="f16",
        help="KV cache type (q8_0 and q4_0 hold about 2x and 3.5x the context in the same memory)",
    )
    g.add_argument(
        "--flash-attn",
        choices=("on", "off", "auto"),
        default="auto",
        help="flash attention (default auto: where the backend has it)",
    )
    g.add_argument("--queue", type=_count(0, 1 << 16, "--queue"), metavar="N",
                   help="requests that may wait for a slot before the API answers 429 (default: 4 per slot, at "
                        "least 16)")  # fmt: skip
    g.add_argument("--batch-size", type=_count(1, 1 << 17, "--batch-size"), metavar="N", help="logical batch size")
    g.add_argument("--ubatch-size", type=_count(1, 1 << 17, "--ubatch-size"), metavar="N",
                   help="physical batch size (prompt tokens per step)")  # fmt: skip
    g.add_argument("--chat-template", type=chat_template, metavar="NAME|FILE",
                   help="a built-in template's name or a Jinja file (default: the model's own; a model without one "
                        "gets its architecture's built-in template)")  # fmt: skip
    g.add_argument(
        "--jinja",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="llama-server's Jinja template engine (its default: on)",
    )
    g.add_argument("--rope-scaling", choices=("none", "linear", "yarn"), help="RoPE scaling method")
    g.add_argument("--rope-freq-scale", type=float, metavar="X", help="RoPE frequency scale (context is 1/X times)")
    g.add_argument("--reasoning-format", choices=("none", "deepseek", "deepseek-legacy", "auto"),
                   help="where thinking goes in answers (llama-server's --reasoning-format)")  # fmt: skip
    for flag in SAMPLING:
        g.add_argument(flag, type=_sampling_value(flag), metavar="X",
                       help=f"default {flag[2:]} for requests that do not say")  # fmt: skip


def tuning_from(args: argparse.Namespace) -> Tuning:
    tpl: str | None = args.chat_template
    is_file = tpl is not None and tpl not in BUILTIN_TEMPLATES
    if args.rope_freq_scale is not None and not (math.isfinite(args.rope_freq_scale) and args.rope_freq_scale > 0):
        raise UserError("--rope-freq-scale must be a positive number")
    if args.cache_type != "f16" and args.flash_attn == "off":
        raise UserError(f"--cache-type {args.cache_type} needs flash attention: drop --flash-attn off")
    sampling = tuple((flag, v) for flag in SAMPLING if (v := getattr(args, flag[2:].replace("-", "_"))) is not None)
    return Tuning(
        cache_type=args.cache_type, flash_attn=args.flash_attn, batch=args.batch_size, ubatch=args.ubatch_size,
        chat_template=None if is_file else tpl, chat_template_file=Path(tpl).resolve() if is_file and tpl else None,
        jinja=args.jinja, rope_scaling=args.rope_scaling, rope_freq_scale=args.rope_freq_scale,
        reasoning_format=args.reasoning_format, sampling=sampling,
    )  # fmt: skip
