"""Checks for notebook 07 (from notebook to cluster).

The exercise: a job on 3 nodes with 8 GPUs each, launched with torchrun's static
rendezvous; the head node is 10.0.0.5, where another job already holds torchrun's
default port, so this job's store is on port 29400. The learner writes the command
typed on node 2 and lists the global RANKs of node 2's processes. The notebook showed
a 2-node job of 2 processes per node at 127.0.0.1; nothing here can be copied from it.
The check parses the command with torchrun's own argument parser
(``torch.distributed.run.get_args_parser``), so what it accepts is what torchrun
accepts, then compares the options every node must agree on.

Source: torchrun, https://pytorch.org/docs/stable/elastic/run.html ; the rank numbering in
``SimpleElasticAgent._assign_worker_ranks`` (``torch/distributed/elastic/agent/server/api.py``).
"""
from __future__ import annotations

import contextlib
import io
import shlex

from . import Verdict, failed, passed

HEAD_ADDR = "10.0.0.5"
"""Address of the head node (node 0) in the exercise."""
HEAD_PORT = 29400
"""Port of the head node's TCPStore in the exercise: not torchrun's default, 29500, which
another job on the head node already holds."""
DEFAULT_PORT = 29500
"""torchrun's ``--master-port`` when none is given."""
NNODES = 3
NPROC_PER_NODE = 8
NODE_RANK = 2
"""The node the learner writes the command for."""
SCRIPT = "train.py"
JOB = (f"{NNODES} nodes with {NPROC_PER_NODE} GPUs each, static rendezvous, head node (node 0) "
       f"{HEAD_ADDR}, store on port {HEAD_PORT} ({DEFAULT_PORT} is taken there), script "
       f"{SCRIPT}")
"""The exercise's job, in one line."""

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


def check_node_command(command, ranks=None) -> Verdict:
    """Exercise of notebook 07: the torchrun command for node 2 of the job :data:`JOB`,
    and the global RANKs of node 2's processes.

    A right command starts with ``torchrun`` (or ``python -m torch.distributed.run``),
    joins the static rendezvous (``--nnodes 3``, ``--master-addr 10.0.0.5``,
    ``--master-port 29400``), starts ``--nproc-per-node 8`` (or ``gpu`` or ``auto``, one
    process per visible GPU: 8 on these nodes), says ``--node-rank 2`` and
    runs ``train.py``. The right ranks are 16 to 23 (``RANK = node_rank *
    nproc_per_node + LOCAL_RANK``), in any order, as a list, tuple or range of ints.

    Args:
        command: ``str`` (split like a shell would) or ``list`` of ``str``; ``None`` or
            ``""`` means not answered yet.
        ranks: the global RANKs of node 2's processes; ``None`` means not answered yet.

    Returns:
        A :class:`~reducelab.checks.Verdict` that says which option or rank is off and
        why, and never what to write.

    Raises:
        TypeError: ``command`` is neither a ``str`` nor a list of ``str``.
    """
    if command is None or command == "" or command == []:
        return failed(f"No command yet. The job: {JOB}. Write the whole torchrun command "
                      f"typed on node {NODE_RANK}, as one string.")
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
                      f"localhost:0 and a fresh --rdzv-id), so node {NODE_RANK} would never "
                      f"meet the others. Drop it on a multi-node job.")
    if args.rdzv_backend != "static" or args.rdzv_endpoint:
        return failed(f"This uses --rdzv-backend {args.rdzv_backend!r}"
                      f"{' with --rdzv-endpoint ' + args.rdzv_endpoint if args.rdzv_endpoint else ''}. "
                      f"The job uses the static rendezvous, in which each node says which node "
                      f"it is; with c10d the rendezvous hands out node ranks itself, so which "
                      f"RANKs a node gets is not known before the job starts.")
    nodes = _nodes(args.nnodes)
    if nodes != (NNODES, NNODES):
        return failed(f"--nnodes is {args.nnodes!r}; the job has {NNODES} nodes and every node "
                      f"must say so, or the rendezvous waits for nodes that never come (or "
                      f"starts without one).")
    # "gpu" (and "auto", where CUDA is available) start one process per visible GPU, 8 on
    # these nodes (determine_local_world_size in torch/distributed/run.py)
    if args.nproc_per_node not in (str(NPROC_PER_NODE), "gpu", "auto"):
        return failed(f"--nproc-per-node is {args.nproc_per_node!r}; each node has "
                      f"{NPROC_PER_NODE} GPUs, one rank each. With a static rendezvous "
                      f"WORLD_SIZE = nnodes * nproc_per_node, and every node must agree on it.")
    if args.node_rank != NODE_RANK:
        if args.node_rank == NODE_RANK + 1:
            why = (f"--node-rank is {args.node_rank}: node ranks count from 0, like RANK and "
                   f"LOCAL_RANK, so a {NNODES}-node job has node ranks 0 to {NNODES - 1}")
        elif args.node_rank == 0:
            why = ("--node-rank is 0, the head node's (also the default when it is left out): "
                   f"two nodes would both claim RANK 0 to {NPROC_PER_NODE - 1}")
        else:
            why = f"--node-rank is {args.node_rank}, not the node this command is for"
        return failed(f"{why}. Which node is this command for?")
    if args.master_addr != HEAD_ADDR:
        if args.master_addr in ("127.0.0.1", "localhost", "::1", "[::1]"):
            why = (f"--master-addr is {args.master_addr!r}"
                   f"{' (the default when it is left out)' if args.master_addr == '127.0.0.1' else ''}"
                   f": on node {NODE_RANK} that is node {NODE_RANK} itself, where no TCPStore "
                   f"is listening")
        else:
            why = f"--master-addr is {args.master_addr!r}"
        return failed(f"{why}. Every node connects to the TCPStore of the head node, node 0.")
    if args.master_port != HEAD_PORT:
        if args.master_port is None or args.master_port == DEFAULT_PORT:
            why = (f"{'--master-port is left out, so torchrun uses its default, ' if args.master_port is None else '--master-port is '}"
                   f"{DEFAULT_PORT}: on the head node that port belongs to the other job, whose "
                   f"store would answer instead of this job's")
        else:
            why = f"--master-port is {args.master_port}, not the port this job's store uses"
        return failed(f"{why}. Every node must give the port of this job's store.")
    if args.training_script != SCRIPT:
        return failed(f"The script is {args.training_script!r}; every node runs the same "
                      f"training script, {SCRIPT}.")
    return _check_ranks(ranks)


def _check_ranks(ranks) -> Verdict:
    first = NODE_RANK * NPROC_PER_NODE
    want = list(range(first, first + NPROC_PER_NODE))
    if ranks is None:
        return failed(f"The command is right. Now node{NODE_RANK}_ranks: the global RANKs "
                      f"of node {NODE_RANK}'s {NPROC_PER_NODE} processes, as a list.")
    try:
        got = sorted(int(r) for r in ranks)
    except (TypeError, ValueError):
        return failed(f"The command is right. node{NODE_RANK}_ranks is {ranks!r}; give the "
                      f"RANKs as a list of whole numbers.")
    if got == want:
        return passed(f"Node {NODE_RANK} joins the static rendezvous at {HEAD_ADDR}:{HEAD_PORT}. "
                      f"Its {NPROC_PER_NODE} ranks get LOCAL_RANK 0 to {NPROC_PER_NODE - 1}, "
                      f"RANK {want[0]} to {want[-1]} (= node_rank * nproc_per_node + "
                      f"LOCAL_RANK), GROUP_RANK {NODE_RANK} and WORLD_SIZE "
                      f"{NNODES * NPROC_PER_NODE}; pick each GPU with LOCAL_RANK.")
    if len(got) != NPROC_PER_NODE or len(set(got)) != len(got):
        why = (f"one RANK per process, {NPROC_PER_NODE} processes on the node"
               if len(set(got)) == len(got) else "each RANK belongs to one process only")
        return failed(f"The command is right. node{NODE_RANK}_ranks holds {len(got)} "
                      f"numbers; {why}.")
    if got == list(range(NPROC_PER_NODE)):
        why = ("Those are LOCAL_RANKs, which every node numbers from 0; RANK is global, "
               "counted over the whole job")
    elif got == [r + 1 for r in want]:
        why = "RANK counts from 0, as the node ranks do: node 0 holds RANK 0"
    elif got[0] == first - NPROC_PER_NODE:
        why = f"Those are node {NODE_RANK - 1}'s: node ranks count from 0"
    elif got[0] == first + NPROC_PER_NODE:
        why = f"Those would be node {NODE_RANK + 1}'s: node ranks count from 0"
    else:
        why = "torchrun numbers ranks node by node, every node holding nproc_per_node of them"
    return failed(f"The command is right, but node {NODE_RANK}'s processes do not get RANKs "
                  f"{got[0]} to {got[-1]}. {why}.")
