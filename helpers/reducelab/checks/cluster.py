"""Checks for notebook 07 (from notebook to cluster).

The exercise: write the torchrun command line for node 1 of a 2-node job, given the
command the head node (node 0) runs. The check parses the answer with torchrun's own
argument parser (``torch.distributed.run.get_args_parser``), so what it accepts is what
torchrun accepts, then compares the options that must agree across nodes.

Source: torchrun, https://pytorch.org/docs/stable/elastic/run.html
"""
from __future__ import annotations

import contextlib
import io
import shlex

from . import Verdict, failed, passed

HEAD_ADDR = "10.0.0.1"
"""Address of the head node (node 0) in the exercise."""
HEAD_PORT = 29500
"""Port of the head node's TCPStore in the exercise (torchrun's static default)."""
NNODES = 2
NPROC_PER_NODE = 4
SCRIPT = "train.py"

HEAD_NODE_COMMAND = (f"torchrun --nnodes {NNODES} --node-rank 0 --nproc-per-node {NPROC_PER_NODE} "
                     f"--master-addr {HEAD_ADDR} --master-port {HEAD_PORT} {SCRIPT}")
"""What node 0 runs in the exercise: a static rendezvous at 10.0.0.1:29500, 4 ranks a node."""

_PREFIXES = (["torchrun"], ["python", "-m", "torch.distributed.run"],
             ["python3", "-m", "torch.distributed.run"])


def _split(command) -> list[str]:
    if isinstance(command, str):
        return shlex.split(command)
    if isinstance(command, (list, tuple)) and all(isinstance(a, str) for a in command):
        return list(command)
    raise TypeError(f"give the command as a str or a list of str, got {type(command).__name__}")


def _nodes(nnodes: str) -> tuple[int, int] | None:
    try:
        parts = [int(p) for p in nnodes.split(":")]
    except ValueError:
        return None
    if len(parts) == 1:
        return parts[0], parts[0]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def check_node_command(command) -> Verdict:
    """Exercise of notebook 07: the torchrun command for node 1 of 2.

    Node 0 runs :data:`HEAD_NODE_COMMAND`. A right answer starts with ``torchrun`` (or
    ``python -m torch.distributed.run``), uses the same static rendezvous (``--nnodes 2``,
    ``--master-addr 10.0.0.1``, port 29500, given or default), ``--nproc-per-node 4``,
    ``--node-rank 1`` and runs ``train.py``.

    Args:
        command: ``str`` (split like a shell would) or ``list`` of ``str``; ``None`` means
            not answered yet.

    Returns:
        A :class:`~reducelab.checks.Verdict` that says which option is off and why.

    Raises:
        TypeError: ``command`` is neither a ``str`` nor a list of ``str``.
    """
    if command is None or command == "" or command == []:
        return failed("No command yet. Start from node 0's command, "
                      f"`{HEAD_NODE_COMMAND}`, and change what differs on node 1.")
    argv = _split(command)
    prefix = next((p for p in _PREFIXES if argv[:len(p)] == p), None)
    if prefix is None:
        return failed(f"The command starts with {' '.join(argv[:3])!r}; start it with "
                      f"`torchrun` (or `python -m torch.distributed.run`), the launcher that "
                      f"starts the {NPROC_PER_NODE} ranks of the node and sets RANK, "
                      f"WORLD_SIZE, MASTER_ADDR, ... for them.")
    from torch.distributed.run import get_args_parser
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser = get_args_parser()
            parser.prog = "torchrun"
            args = parser.parse_args(argv[len(prefix):])
    except SystemExit:
        last = err.getvalue().strip().splitlines()
        return failed(f"torchrun's own parser refuses it: {last[-1] if last else 'bad options'}.")
    if args.standalone:
        return failed("`--standalone` is for one node: it replaces the rendezvous options "
                      "with a private rendezvous on a free port of this node (--rdzv-endpoint "
                      "localhost:0 and a fresh --rdzv-id), so node 1 would never meet node 0. "
                      "Drop it on a multi-node job.")
    if args.rdzv_backend != "static" or args.rdzv_endpoint:
        return failed(f"Node 0 uses the static rendezvous (--master-addr/--master-port, "
                      f"--node-rank); node 1 must join the same one, but this uses "
                      f"--rdzv-backend {args.rdzv_backend!r}"
                      f"{' with --rdzv-endpoint ' + args.rdzv_endpoint if args.rdzv_endpoint else ''}. "
                      f"Both nodes must give the same rendezvous options.")
    nodes = _nodes(args.nnodes)
    if nodes != (NNODES, NNODES):
        return failed(f"--nnodes is {args.nnodes!r}; the job has {NNODES} nodes and every node "
                      f"must say so, or the rendezvous waits for nodes that never come (or "
                      f"starts without one).")
    if args.nproc_per_node != str(NPROC_PER_NODE):
        return failed(f"--nproc-per-node is {args.nproc_per_node!r}; node 1 has "
                      f"{NPROC_PER_NODE} GPUs, one rank each, like node 0. With a static "
                      f"rendezvous WORLD_SIZE = nnodes * nproc_per_node = "
                      f"{NNODES * NPROC_PER_NODE}, and every node must agree on it.")
    if args.node_rank != 1:
        if args.node_rank == 0:
            return failed("Two nodes would both claim RANK 0 to "
                          f"{NPROC_PER_NODE - 1}. Which option tells torchrun which node "
                          "this is?")
        return failed(f"--node-rank is {args.node_rank}, but the node ranks of a "
                      f"{NNODES}-node job run from 0 to {NNODES - 1}, and 0 is the head "
                      f"node's.")
    if args.master_addr != HEAD_ADDR:
        if args.master_addr in ("127.0.0.1", "localhost", "::1", "[::1]"):
            why = (f"--master-addr is {args.master_addr!r}"
                   f"{' (the default when it is left out)' if args.master_addr == '127.0.0.1' else ''}"
                   f": on node 1 that is node 1 itself, where no TCPStore is listening")
        else:
            why = f"--master-addr is {args.master_addr!r}"
        return failed(f"{why}. Every node connects to the head node's TCPStore, at "
                      f"{HEAD_ADDR}.")
    if args.master_port not in (None, HEAD_PORT):
        return failed(f"--master-port is {args.master_port}; node 0's TCPStore listens on "
                      f"{HEAD_PORT}, so node 1 must use that port (or leave it out: the "
                      f"default is {HEAD_PORT}).")
    if args.training_script != SCRIPT:
        return failed(f"The script is {args.training_script!r}; every node runs the same "
                      f"training script, {SCRIPT}.")
    return passed(f"Node 1 joins node 0's static rendezvous at {HEAD_ADDR}:{HEAD_PORT}. Its "
                  f"{NPROC_PER_NODE} ranks get LOCAL_RANK 0 to {NPROC_PER_NODE - 1}, RANK "
                  f"{NPROC_PER_NODE} to {2 * NPROC_PER_NODE - 1} (= node_rank * nproc_per_node "
                  f"+ LOCAL_RANK), GROUP_RANK 1 and WORLD_SIZE {NNODES * NPROC_PER_NODE}.")
