"""Where one token's time goes in a split: each RPC command timestamped on the host and every worker.

    .venv/bin/python benchmarks/stage_trace.py [--workers 2] [--tokens 48] [--clients 4]   (this machine, tiny model)
    python3 benchmarks/gpu_split.py --carry gpuc --pipeline --trace [--nodes 2,3,4] [--trace-clients 1,4]  (device)

The chain is llama.cpp's worker-to-worker split (patch 0011): N-1 rpc-servers on loopback, each with a peer
listener, and llama-server with the last layers and the output (``GGML_RPC_PEERS``), every process started with
``GGML_RPC_TRACE`` (patch 0015): one clock for all of them, since they share the machine. After a warm-up, one greedy
completion of --tokens tokens (with --clients C, C of them at once on C slots: each decoding step then carries one
token of every client through the chain); each step is cut into the segments of its critical path:

  host → w0     from the host having the last worker's output (GET_TENSOR back) to the first worker's compute:
                the host's own layers, output and sampling and the next token's graph (to its first command queued
                for w0), the next token's inputs and graph queued for w0 (first to last), then to w0's compute
                start (written, read, set)
  compute wK    worker K's graph compute (GRAPH_RECOMPUTE: the graph is kept on the server across tokens)
  wK → wK+1     from K's compute done to K+1's compute start: K's device → host copy of the hidden state (D2H),
                the frame on the peer link (link), K+1's thread waking on it (wake), its host → device copy and the
                command that starts the compute (set+start)
  wLast → host  from the last worker's compute done to the host holding the tensor (the GET's round trip)

Each segment is the median over the decoded tokens (the first two left out), in ms; "stage overhead" is the token's
time less the workers' compute and the host's own part. "host waits per token" counts the times llama-server's
thread slept on a connection (≥ 5 µs: waits on events already done are ~0.1 µs and are left out), "host blocked" adds
up every wait of the token, in ms.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from common import print_trace_table, traced_chain  # benchmarks/common.py: the tracing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--clients", type=int, default=1, help="streams at once, on as many slots (default 1)")
    ap.add_argument("--model", type=Path, default=None, help="default: the tiny test model")
    ap.add_argument(
        "--host-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="in llama-server's environment (e.g. GGML_RPC_QUEUE_INPUTS=0: patch 0016 off)",
    )
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from common import header  # benchmarks/common.py

    from meshllm.llama.build import find_binaries
    from meshllm.llama.gguf import layer_of, read_header
    from meshllm.models.tiny import tiny_model_path

    header()
    model = args.model or tiny_model_path()
    n_layer = 1 + max(x for t in read_header(model).tensors if (x := layer_of(t.name)) is not None)
    n = args.workers  # a CPU host has no device of its own in llama.cpp's split: its workers take every layer
    layers = [n_layer // n + (1 if i < n_layer % n else 0) for i in range(n)] + [0]
    work = Path(tempfile.mkdtemp(prefix="stage-trace-"))
    host_env = dict(x.split("=", 1) for x in args.host_env)
    rows = traced_chain(find_binaries(stock=False), model, args.workers, args.tokens, work, layers, None, host_env,
                        args.clients)  # fmt: skip
    many = f" × {args.clients} clients" if args.clients > 1 else ""
    print_trace_table(f"# {model.name}: {args.workers} workers + host on this machine's CPU, layers {layers[:-1]} "
                f"(the output on the last worker){' ' + ' '.join(args.host_env) if args.host_env else ''}, "
                f"{args.tokens} greedy tokens{many}", rows)  # fmt: skip


if __name__ == "__main__":
    main()
