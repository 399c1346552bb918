"""Checks for notebook 07 (from notebook to cluster).

The exercise: a job on 3 nodes with 8 GPUs each, launched with torchrun's static
rendezvous; the head node is 10.0.0.5, where another job already holds torchrun's
default port, so this job's store is on port 29400. The learner writes the command
typed on node 2, lists the global RANKs of node 2's processes, and says on which node,
with which LOCAL_RANK, the process of global RANK 13 runs. The notebook showed
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
import os
import re
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
IFNAME = "eth1"
"""Node 2's interface on the cluster network that the nodes share; its other one, eth0, is
a network of its own that the other nodes cannot reach (review 6, 07-3: the exercise was
mostly copying the notebook's launch)."""
OWN_IFNAME = "eth0"
JOB = (f"{NNODES} nodes with {NPROC_PER_NODE} GPUs each (NCCL), static rendezvous, head node "
       f"(node 0) {HEAD_ADDR}, store on port {HEAD_PORT} ({DEFAULT_PORT} is taken there), "
       f"script {SCRIPT}; node {NODE_RANK} reaches the other nodes through {IFNAME} "
       f"({OWN_IFNAME} is a network of its own)")
"""The exercise's job, in one line."""
ASKED_RANK = 13
"""The global RANK whose node and LOCAL_RANK the exercise asks for: node 1, LOCAL_RANK 5."""

_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_PYTHON = re.compile(r"python[0-9.]*")
_SEPARATORS = (";", "&&")


def _launcher_args(argv: list[str]) -> tuple[dict, list[str], list[str] | None, dict]:
    """``(the variables set for torchrun as a dict, argv without them, torchrun's own
    arguments, the variables set for the shell only)``. Variables reach torchrun as
    leading ``VAR=value`` words or from ``export VAR=value`` statements before it, ended by
    ``;`` or ``&&`` (review 7, 07-5: ``export NCCL_SOCKET_IFNAME=eth1; torchrun ...`` was
    refused); a statement ``VAR=value;`` without ``export`` sets a shell variable that
    torchrun's processes do not inherit. The third is ``None`` when the command does not
    start torchrun: ``torchrun`` or an interpreter running ``-m torch.distributed.run``, by
    any path, after nothing but such statements."""
    env, shell_only = {}, {}
    while any(word in _SEPARATORS for word in argv):
        end = next(i for i, word in enumerate(argv) if word in _SEPARATORS)
        statement, argv = argv[:end], argv[end + 1:]
        exported = statement[:1] == ["export"]
        words = statement[1:] if exported else statement
        if not words or not all(_ASSIGNMENT.match(word) for word in words):
            return env, statement, None, shell_only   # something else runs before torchrun
        for word in words:
            name, _, value = word.partition("=")
            (env if exported else shell_only)[name] = value
    while argv and _ASSIGNMENT.match(argv[0]):      # NCCL_SOCKET_IFNAME=eth1 torchrun ...
        name, _, value = argv[0].partition("=")
        env[name] = value
        argv = argv[1:]
    name = os.path.basename(argv[0]) if argv else ""
    if name == "torchrun":
        return env, argv, argv[1:], shell_only
    if _PYTHON.fullmatch(name) and argv[1:3] == ["-m", "torch.distributed.run"]:
        return env, argv, argv[3:], shell_only
    return env, argv, None, shell_only


def _split(command) -> list[str]:
    if isinstance(command, str):
        lexer = shlex.shlex(command, posix=True, punctuation_chars=";&")   # `;` and `&&` apart
        lexer.whitespace_split = True
        return list(lexer)
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


def check_node_command(command, ranks=None, rank13=None) -> Verdict:
    """Exercise of notebook 07: the torchrun command for node 2 of the job :data:`JOB`,
    the global RANKs of node 2's processes, and where the process of global RANK 13 runs.

    A right command starts with ``torchrun`` (or an interpreter running ``-m
    torch.distributed.run``, by any path), after any ``VAR=value`` words that set its
    environment or ``export VAR=value;`` (or ``&&``) statements; joins the static rendezvous (``--nnodes 3``, ``--master-addr 10.0.0.5``
    and ``--master-port 29400``, or ``--rdzv-backend static --rdzv-endpoint
    10.0.0.5:29400``, which takes their place); starts ``--nproc-per-node 8`` (or ``gpu`` or ``auto``, one
    process per visible GPU: 8 on these nodes), says ``--node-rank 2`` and
    runs ``train.py``. The right ranks are 16 to 23 (``RANK = node_rank *
    nproc_per_node + LOCAL_RANK``), in any order, as a list, tuple or range of ints.
    ``rank13`` is ``(node rank, LOCAL_RANK)`` of RANK 13: ``(1, 5)``. The command sets
    ``NCCL_SOCKET_IFNAME`` to :data:`IFNAME` (or ``=eth1``, NCCL's exact match) in front:
    NCCL picks an interface itself where it is unset (NCCL's docs, "NCCL_SOCKET_IFNAME"),
    and on node 2 it may pick eth0, which the other nodes cannot reach.

    Args:
        command: ``str`` (split like a shell would) or ``list`` of ``str``; ``None`` or
            ``""`` means not answered yet.
        ranks: the global RANKs of node 2's processes; ``None`` means not answered yet.
        rank13: ``(node rank, LOCAL_RANK)`` of the process of global RANK 13; ``None``
            means not answered yet.

    Returns:
        A :class:`~reducelab.checks.Verdict` that says which option or rank is off and
        why, and never what to write.

    Raises:
        TypeError: ``command`` is neither a ``str`` nor a list of ``str``.
    """
    if command is None or command == "" or command == []:
        return failed(f"No command yet. The job: {JOB}. Write the whole torchrun command "
                      f"typed on node {NODE_RANK}, as one string.")
    env, argv, own, shell_only = _launcher_args(_split(command))
    if own is None:
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
            args = parser.parse_args(own)
    except SystemExit:
        last = err.getvalue().strip().splitlines()
        return failed(f"torchrun's own parser refuses it: {last[-1] if last else 'bad options'}.")
    if args.standalone:
        return failed("`--standalone` is for one node: it replaces the rendezvous options "
                      "with a private rendezvous on a free port of this node (--rdzv-endpoint "
                      f"localhost:0 and a fresh --rdzv-id), so node {NODE_RANK} would never "
                      f"meet the others. Drop it on a multi-node job.")
    if args.rdzv_backend != "static":
        return failed(f"This uses --rdzv-backend {args.rdzv_backend!r}. The job uses the static "
                      f"rendezvous, in which each node says which node it is; with "
                      f"{args.rdzv_backend} the rendezvous hands out node ranks itself, so which "
                      f"RANKs a node gets is not known before the job starts.")
    # With the static rendezvous, --rdzv-endpoint HOST:PORT takes the place of --master-addr
    # and --master-port (get_rdzv_endpoint in torch/distributed/run.py).
    if args.rdzv_endpoint:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            return failed(f"--rdzv-endpoint is {args.rdzv_endpoint!r}: the static rendezvous "
                          f"needs HOST:PORT there, and torchrun refuses an endpoint without a "
                          f"port (\"Port is absent in endpoint\").")
        addr, port, said = host.strip("[]"), int(port), ("--rdzv-endpoint's host",
                                                          "--rdzv-endpoint's port")
    else:
        addr, port, said = args.master_addr, args.master_port, ("--master-addr", "--master-port")
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
    if addr != HEAD_ADDR:
        if addr in ("127.0.0.1", "localhost", "::1"):
            why = (f"{said[0]} is {addr!r}"
                   f"{' (the default when it is left out)' if addr == '127.0.0.1' and not args.rdzv_endpoint else ''}"
                   f": on node {NODE_RANK} that is node {NODE_RANK} itself, where no TCPStore "
                   f"is listening")
        else:
            why = f"{said[0]} is {addr!r}"
        return failed(f"{why}. Every node connects to the TCPStore of the head node, node 0.")
    if port != HEAD_PORT:
        if port is None or port == DEFAULT_PORT:
            why = (f"{'--master-port is left out, so torchrun uses its default, ' if port is None else said[1] + ' is '}"
                   f"{DEFAULT_PORT}: on the head node that port belongs to the other job, whose "
                   f"store would answer instead of this job's")
        else:
            why = f"{said[1]} is {port}, not the port this job's store uses"
        return failed(f"{why}. Every node must give the port of this job's store.")
    if args.training_script != SCRIPT:
        return failed(f"The script is {args.training_script!r}; every node runs the same "
                      f"training script, {SCRIPT}.")
    verdict = _check_interface(env, shell_only)
    if not verdict:
        return verdict
    verdict = _check_ranks(ranks)
    return _check_where(rank13) if verdict else verdict


def _check_interface(env: dict, shell_only: dict) -> Verdict:
    """Node 2's collectives go through NCCL over :data:`IFNAME`, named in the command's
    environment by ``NCCL_SOCKET_IFNAME``; NCCL reads a plain value as a prefix of the
    interface names and ``=name`` as the exact name (NCCL's docs, "NCCL_SOCKET_IFNAME")."""
    nccl = env.get("NCCL_SOCKET_IFNAME")
    if nccl in (IFNAME, f"={IFNAME}"):
        return passed("the interface")
    if nccl is None and "GLOO_SOCKET_IFNAME" in env:
        return failed("The options are right. GLOO_SOCKET_IFNAME pins gloo's sockets only, "
                      "and this job's GPUs run their collectives through NCCL, which reads a "
                      "variable of its own.")
    if nccl is None and "NCCL_SOCKET_IFNAME" in shell_only:
        return failed("The options are right, but NCCL_SOCKET_IFNAME is set for the shell only: "
                      "without `export`, a variable set in a statement of its own is not in the "
                      "environment of the programs the shell starts, so torchrun's ranks, and "
                      "NCCL in them, never see it.")
    if nccl is None:
        return failed(f"The options are right, but nothing names the network interface. "
                      f"Where it is not told, NCCL picks one itself, and on node {NODE_RANK} "
                      f"it may pick {OWN_IFNAME}, a network the other nodes cannot reach.")
    if nccl.lstrip("=") == OWN_IFNAME:
        return failed(f"The options are right, but NCCL_SOCKET_IFNAME is {nccl!r}, node "
                      f"{NODE_RANK}'s network of its own: NCCL there would listen and connect "
                      f"where the other nodes cannot reach it.")
    if nccl and not nccl.startswith(("=", "^")) and OWN_IFNAME.startswith(nccl):
        return failed(f"The options are right, but NCCL_SOCKET_IFNAME is {nccl!r}: NCCL reads a "
                      f"plain value as the start of the interface names it may use, so "
                      f"{nccl!r} lets it pick {OWN_IFNAME} too, a network the other nodes "
                      f"cannot reach.")
    return failed(f"The options are right, but NCCL_SOCKET_IFNAME is {nccl!r}, which does not "
                  f"name {IFNAME}, the interface node {NODE_RANK} shares with the others "
                  f"(a plain value is the start of the names NCCL may use, '=name' one exact "
                  f"name).")


def _check_where(where) -> Verdict:
    """``(node rank, LOCAL_RANK)`` of global RANK :data:`ASKED_RANK`."""
    node, local = divmod(ASKED_RANK, NPROC_PER_NODE)
    name = f"rank{ASKED_RANK}_node_and_local_rank"
    if where is None:
        return failed(f"The command and node {NODE_RANK}'s RANKs are right. Now {name}: the "
                      f"node rank and the LOCAL_RANK of the process whose global RANK is "
                      f"{ASKED_RANK}, as a tuple (node rank, LOCAL_RANK).")
    try:
        got = tuple(int(v) for v in where)
    except (TypeError, ValueError):
        got = None
    if got is None or len(got) != 2:
        return failed(f"{name} is {where!r}; give two whole numbers, (node rank, LOCAL_RANK).")
    if got == (node, local):
        return passed(f"Node {NODE_RANK} joins the static rendezvous at {HEAD_ADDR}:{HEAD_PORT}. "
                      f"Its {NPROC_PER_NODE} ranks get LOCAL_RANK 0 to {NPROC_PER_NODE - 1}, "
                      f"RANK {NODE_RANK * NPROC_PER_NODE} to {NODE_RANK * NPROC_PER_NODE + NPROC_PER_NODE - 1} "
                      f"(= node_rank * nproc_per_node + LOCAL_RANK), GROUP_RANK {NODE_RANK} and "
                      f"WORLD_SIZE {NNODES * NPROC_PER_NODE}. Going back, RANK {ASKED_RANK} is "
                      f"{ASKED_RANK} // {NPROC_PER_NODE} = node {node}, LOCAL_RANK "
                      f"{ASKED_RANK} % {NPROC_PER_NODE} = {local}: it drives cuda:{local} of "
                      f"node {node}. Pick each GPU with LOCAL_RANK.")
    if got == (local, node):
        why = "That is the pair the other way round: the node rank comes first"
    elif got[1] == ASKED_RANK or not 0 <= got[1] < NPROC_PER_NODE:
        why = (f"LOCAL_RANK counts within a node, from 0 to {NPROC_PER_NODE - 1}, one per GPU "
               f"of the node")
    elif not 0 <= got[0] < NNODES:
        why = f"the job's node ranks are 0 to {NNODES - 1}"
    elif got[0] * NPROC_PER_NODE + got[1] == ASKED_RANK + NPROC_PER_NODE:
        why = "Node ranks count from 0: node 0 holds the first ranks"
    else:
        why = (f"node rank {got[0]} and LOCAL_RANK {got[1]} give RANK "
               f"{got[0] * NPROC_PER_NODE + got[1]} with {NPROC_PER_NODE} processes a node, "
               f"not {ASKED_RANK}")
    return failed(f"The command and node {NODE_RANK}'s RANKs are right, but not {name}: {why}.")


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
        return passed("node 2's RANKs")
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
