"""What each predict-then-run question reveals: the sentences that explain the real result.

They live here, not in the notebooks' question cells, so that a cell's source gives no answer
away: a learner reads the cell that runs a question right below the cell where they write
their prediction (the brief's "predictions stay unspoiled"). :func:`reducelab.checks.reveal`
shows the text only inside the folded ``<details>`` of its verdict.

Keyed by notebook (``"01"`` to ``"18"``) and question number (``answer_1`` is question 1).
An entry is a ``str``, or a function of values the question cell computed (keyword
arguments) that returns one.
"""
from __future__ import annotations


def _first_bucket() -> str:
    import torch.distributed as dist

    from .cost import size_label
    return size_label(dist._DEFAULT_FIRST_BUCKET_BYTES)


WHY = {
    "01": {
        1: "before = value copies nothing: it gives the same tensor a second name. "
            "all_reduce writes the sum, 1 + 2 + 3 + 4 = 10, into that tensor in place, so "
            "before shows 10 on every rank and the input is gone. To keep it, copy it "
            "first: before = value.clone(), as the explorer's rank function below does, or "
            "read a Python number with .item() as step 1 did.",
        2: "gloo's AVG is a SUM followed by a true division by world_size. The SUM, "
            "1 + 2 + 3 + 4 = 10, is written into x on every rank first; the division then "
            "gives a float, which cannot be written back into an int64 tensor, and only "
            "then does the call raise. The hidden error leaves every rank holding the sum, "
            "4 times the mean of 2.5, as if it were the result. Use float32, or SUM and "
            "divide yourself, and never hide a collective's error.",
        3: "MIN writes the smallest value, 1, into every rank's tensor. Ranks 1 and 3 "
            "already hold 1: a tie changes nothing, so both keep what they had, while ranks "
            "0 and 2 are lowered to 1. MIN and MAX change only the ranks that do not already "
            "hold the result; SUM of positive inputs changes every rank.",
    },
    "02": {
        1: "Every rank's. dst only decides where the gather (Step 3's part 3) sends the "
            "sums; the cut and the reduce-scatter are the same for any dst. At 2 elements "
            "both lie in chunk 0, rank 0's, so its sum builds on rank 0 along 3 -> 2 -> 1 -> 0 "
            "as in Step 2: rank 1 is left with 1110, rank 2 with 1100, and rank 0, not dst, "
            "with the full sum 1111. Then rank 0 sends chunk 0 to dst=3, whose x now holds "
            "1111 too. With dst=0 rank 3 kept its input because it only ever sends; with "
            "dst=3 it receives the result, and rank 0 still does the ring's work.",
        2: "x.detach() and x.numpy() share x's storage (shares x's "
            "storage: True), so they show what reduce wrote. detach() only cuts the new "
            "tensor off from autograd: \"Returned Tensor shares the same storage with the "
            "original one\" (its docstring). numpy() hands NumPy the same memory: \"changes "
            "to the tensor will be reflected in the ndarray and vice versa\". r is a copy: "
            "after .t() the elements no longer lie in memory in the order a flat view would "
            "read them, so reshape could not return a view, and \"Otherwise, it will be a "
            "copy\" (torch.reshape's docstring), made before the reduce. That docstring adds "
            "that \"you should not depend on the copying vs. viewing behavior\": when you "
            "mean an alias, write view(), which raises instead of copying (\"view size is "
            "not compatible with input tensor's size and stride\"); when you mean a copy, "
            "write clone().",
        3: "async_op=True does not copy x: gloo reads rank 1's x only when it sends it, on a "
            "background thread, and over TCP it sends only once the receiver has posted its "
            "receive (\"Execute this send if there is a remote pending receive\", Pair::send "
            "in gloo/transport/tcp/pair.cc). In run (a) dst had not called reduce yet, so the "
            "write came first: rank 1 sent 15 and dst ended with 16. In run (b) dst's reduce "
            "was done, and the write changed only rank 1's own x. The docs promise the result "
            "only once wait() has returned (for CPU collectives it blocks \"until the operation "
            "is completed\") and nothing about a tensor written before that. In a real "
            "program nothing pins the moment, and timing alone decides (an optional part "
            "after the lesson runs it). "
            "Wait first, then write.",
    },
    "03": {
        1: "mean_of_means counts each rank's mean once, whatever its batch size, and "
            "divides by world_size = 2. Rank 0's one sample is its whole mean, so it weighs "
            "1/2: raised by 1, the result moves by 0.5. Each of rank 1's three samples is a "
            "third of rank 1's mean and weighs 1/6. In the global mean every sample weighs "
            "the same, 1/4. So mean_of_means gives (2.0 + 0.0) / 2 = 1.0, twice the global "
            "mean 0.5: the small batch's sample pulls it its way.",
        2: "Added up over the four ranks, the gradients of sum / 32 would make the "
            "full-batch mean. But DDP averages the ranks' gradients instead of adding them: "
            "it divides each by world_size = 4 during backward() (notebook 04 shows where in "
            "torch), so a quarter of the reference is left. Multiplying each loss by "
            "world_size undoes that division.",
        3: "all_reduce changed the loss's value, but autograd recorded nothing for it: "
            "without an autograd kernel, the all_reduce wrote into reduced in place and left "
            "its history as the clone made it (after it, reduced.grad_fn is CloneBackward0, the "
            "clone's: the evidence). backward() therefore runs from reduced / world_size "
            "through the clone to the loss, as if the all_reduce were the identity; only the "
            "division by world_size is left, 1 / 2 on both ranks. So each rank gets "
            "its own local gradient divided by 2: the two gradients differ, and no rank "
            "learned from the other's data. Nothing was exchanged in backward(). torch's "
            "warning above says only that c10d::allreduce_ has no autograd kernel, and that "
            "this may be silently incorrect.",
    },
    "04": {
        1: "somelib's feature check reads dist.reduce_op once, and that read warns; the DDP "
            "step adds none. DDP does not look at how your loss reduces and has nothing to "
            "warn about, and nothing in a DDP step reads torch.distributed.reduce_op: each "
            "rank's one warning names the hasattr line. The optional myth section runs the "
            "answer's custom loss too, with the same result.",
        2: "Each rank's mean divides by its own local batch, 84 on rank 0, and DDP then "
            "divides by world_size = 4 before it sums: a sample on rank 0 weighs "
            "1/(4 x 84) = 1/336 in DDP's gradient, against 1/840 in one process's mean over "
            "the whole batch, and 840/336 = 2.5. Samples on the small ranks count more, those "
            "on the big ranks less (rank 3's: 840/(4 x 336) = 0.625): a different gradient, "
            "not a rescaled one. Equal local batches give every sample 1.",
        3: "As many as without no_sync. DDP decides at the forward whether the backward "
            "all-reduces: the forward reads require_backward_grad_sync, which no_sync() sets "
            "to False, and when it is True prepares the reducer for a synced backward "
            "(_post_forward in torch/nn/parallel/distributed.py). A forward run outside "
            "no_sync() all-reduces in its backward, wherever that backward runs. With the "
            "forward inside too, .grad only accumulates locally for the first 3 micro-batches "
            "and the last one's backward all-reduces the sum once: 1 per step. no_sync's "
            "docstring says so: the forward pass should be included inside the context manager.",
    },
    "05": {
        1: "Row-major, rank r of a (dp=2, cp=4) mesh sits at (r // 4, r % 4): "
            "rank 5 at (1, 1). Its dp group is its column, the ranks of cp index 1, cp = 4 "
            "apart: 1 and 5. Its cp group would be its row, 4, 5, 6 and 7.",
        2: "On gloo, AVG is the first way, a SUM followed by a division by the group size "
            "(that is how pytorch/pytorch#149781 added it, in torch 2.8), so the two run the "
            "same arithmetic and give the same bits, in every dtype here and on any number of "
            "ranks. NCCL builds a float AVG the second way: torch's ProcessGroupNCCL.cpp maps "
            "ReduceOp.AVG to ncclAvg, and NCCL (hostToDevRedOp in src/enqueue.cc) runs a float "
            "ncclAvg as a PreMulSum with 1/N, an integer one as a SUM then a division. With 3 "
            "ranks 1/3 is rounded, and that way differs from SUM/3 in the last bit of many "
            "elements (the evidence's last column). On 4 ranks it would not: 1/4 is a power of "
            "two, so each product is exact (the last evidence row). Neither is the exact mean: "
            "both round the result to the tensor's dtype, so a check against one process needs "
            "a tolerance.",
        3: "A rank sees only its own shard: DTensor.from_local sends nothing to the other "
            "ranks (run_check=False by default), and without shape= and stride= it computes "
            "the global shape \"assuming the given distributed tensor is evenly sharded "
            "across ranks\" (its docstring). So it assumes even shards, and each rank infers "
            "the global shape from its own shard: 3 x 2 = 6 rows on the tp ranks that hold 3 "
            "rows (ranks 0 and 2), 2 x 2 = 4 on those that hold 2 (ranks 1 and 3). Neither is 5, so "
            "the page's branch fails when it assigns the rebuilt gradient to param.grad (the "
            "evidence's last lines). Pass shape=g.shape and "
            "stride=g.stride(), or reduce in place with AVG (or SUM then .div_()) and skip "
            "the rebuild. Skipping the rebuild alone is not enough: the page divides out of "
            "place, so param.grad would keep the SUM (an optional part shows it).",
    },
    "06": {
        1: "Rank r finishes chunk (r + 1) % N: chunk c starts at rank c, picks up one rank "
            "per step, and after N - 1 steps it has reached rank c - 1 = rank r, holding all "
            "N inputs. Each rank now owns one complete chunk: a reduce_scatter.",
        2: "Rank r never sends chunk (r + 1) % N in reduce-scatter (the one it completes, "
            "question 1), nor chunk (r + 2) % N in all-gather (the last one it receives). For "
            "rank 1 those are chunks 2 and 3, the two short ones, so it sends the most: 2 x 10 "
            "- 2 - 2 = 16 elements, 64 bytes. Rank 3 skips the two long ones (56 bytes), ranks "
            "0 and 2 one of each (60). With 12 elements (the evidence's second line) every "
            "chunk holds 3 and every rank sends the same: each of the 2 (N - 1) = 6 steps sends "
            "one chunk of 12 bytes, 72 bytes, 1.5 times the tensor. In general a rank sends "
            "2 (N - 1) / N x S bytes, less than 2 S for any N; a naive all_reduce that sends "
            "the whole tensor to every other rank sends (N - 1) x S, 144 bytes with 12 elements.",
        3: "Chunk c starts at rank c and picks up the ranks to its right "
            "(question 1). Element 0: 1e8 + 1 rounds to 1e8, - 1e8 gives 0, + 1 gives 1. "
            "Element 2: -1e8 + 1 rounds to -1e8, + 1e8 gives 0, + 1 gives 1. Elements 1 and 3 "
            "add their two 1s while a 1e8 is still in the sum, and lose both: 0. A 1 survives "
            "only once the two 1e8s have cancelled.",
    },
    "07": {
        1: "GLOO_SOCKET_IFNAME pins gloo, and only gloo, to the loopback interface: rank 0 "
            "listens on 127.0.0.1. The agent's two TCPStores (the rendezvous's, where the "
            "agents met, and the ranks', at MASTER_ADDR:MASTER_PORT) do not read it: a "
            "TCPStore server binds the wildcard address (::, or 0.0.0.0 on a host without "
            "IPv6; TCPStoreLibUvBackend.cpp), every interface, and the host it is given, "
            "localhost here, is only where its clients connect. It was measured after every "
            "rank had joined, so the stores outlive the rendezvous, and again at the end, after "
            "the ranks' all_reduce: still open.",
        2: "With the static rendezvous, RANK = node_rank * nproc_per_node + LOCAL_RANK = 1 * "
            "2 + 1 = 3. LOCAL_RANK counts within the node, and WORLD_SIZE = nnodes * "
            "nproc_per_node = 4.",
    },
    "08": {
        1: "They are equal, in float32 and in bfloat16. The clue was the table's last column: "
            "gloo's reduce_scatter sends as many bytes as its all_reduce because it runs one. The "
            "gloo library has a reduce_scatter algorithm of its own "
            "(ReduceScatterHalvingDoubling, in gloo/reduce_scatter.h), but ProcessGroupGloo, "
            "torch's gloo backend, does not use it: reduce_scatter_single reaches "
            "ProcessGroupGloo::_reduce_scatter_base (in "
            "torch/csrc/distributed/c10d/ProcessGroupGloo.cpp), which calls "
            "reduce_scatter_tensor_coalesced. That clones the input, all-reduces the whole "
            "clone once, with the same ReduceOp, and copies its piece, "
            "chunk(world_size)[rank], into the output: the calls the profiler recorded below. "
            "So each element of a shard is the very element that all_reduce computes, from "
            "the same additions in the same order, and all_gather only copies bits. Neither "
            "is the exact sum: both round. The pull request that wrote it this way "
            "(pytorch/pytorch#118911) notes that it sends twice what a real reduce_scatter "
            "sends. The equality is this one function's, not a promise: ProcessGroupNCCL "
            "calls ncclReduceScatter and ncclAllReduce, two different collectives (in "
            "ProcessGroupNCCL.cpp), whose order of additions nothing documents as the same, "
            "so compare there with a tolerance of a few units in the last place, not with ==.",
        2: "ZeRO-1 shards the optimizer's state only, and SGD with momentum keeps one "
            "float32 tensor of it per parameter. Per parameter, DDP keeps 4 bytes of the "
            "parameter, 4 of its gradient and 4 of momentum_buffer: 12. ZeRO-1 keeps the same "
            "4 + 4 and a quarter of the 4: 9 of 12, 0.75. Measured on rank 0: 21,708 of 28,944 "
            "bytes (the 2 elements of padding, 2,410 to 2,412, are in both). With Adam (two "
            "state tensors, K = 8) the same stage keeps 10 of 16, 0.625 (Adam's line above; "
            "its 4-byte step counter moves the last digit), and with the paper's "
            "mixed-precision Adam (2 + 2 bytes and K = 12), (2 + 2 + 3) / 16 = 0.44: the "
            "larger the optimizer's state, the more stage 1 saves. Stage 3, which shards all "
            "three, keeps about a quarter.",
    },
    "09": {
        1: "Without f, forward is unchanged, and so is every parameter's gradient: a rank's "
            "gradient for its own shard depends only on its own hidden units and the full "
            "output gradient, which it has, so the weight gradients need no collective at "
            "all. Only x's gradient is wrong: each rank holds the part of it that flows "
            "through its own hidden units, and the sum over ranks, which f's backward "
            "all_reduce would have made, is the right gradient (the cell after this one adds "
            "them up). The bug shows up nowhere in this block; it corrupts everything before "
            "it.",
        2: "One: g's all_reduce after W_o. A head's softmax needs every key of its own head, "
            "and tensor parallelism splits the heads, not the tokens: each rank holds every "
            "token's q, k and v for its heads. The heads meet only in W_o, whose partial sums "
            "g adds up, as in the MLP. Backward runs one collective too, f's.",
        3: "Two: g's all_reduce after the first layer, which ends in partial sums, and the "
            "all_gather that joins the output's columns. Column → row needs one, and keeps "
            "the hidden activation sharded, a quarter of it per rank; row → column holds all "
            "of it on every rank. Why must the sum come before the ReLU? relu(a + b) is not "
            "relu(a) + relu(b): a rank whose part of a hidden unit is -3, where the whole is "
            "+1, would zero its part. Split by columns, each rank holds whole hidden units, "
            "so the ReLU needs no one else (Shoeybi et al. 2019, Megatron-LM, section 3).",
    },
    "10": {
        1: "Every all_reduce pays a fixed cost, whatever its size: system calls, waking the "
            "other rank, a round trip through the loopback. Step 1's 4-byte all_reduce shows "
            "about what it is. 1 KiB adds little to it, so 1,024 calls pay it 1,024 times; "
            "the one 1 MiB call pays it once and then spends its time on the bytes. The same "
            "bytes take about a hundred times as long or more: with small tensors, the number "
            "of calls sets the cost, not the bytes. That is why DDP packs gradients into "
            "buckets (notebook 16). Step 3 names the fixed cost α.",
        2: "The tree. Only the tree leaves 4 ranks with [2, 1, 0, 0]: a chain has three "
            "ranks write S each ([1, 1, 1, 0]), a star has src write 3 S ([3, 0, 0, 0]). In "
            "each round of the tree every rank that holds the tensor sends all of it to one "
            "that does not, so the holders double and src sends once in every round: "
            "ceil(log2 n) rounds, 3 S on 8 ranks ([3, 2, 1, 1, 0, 0, 0, 0] above), 4 S on 16. "
            "That is gloo's broadcast (gloo/broadcast.cc: a binomial tree over the ranks "
            "counted from src). Few rounds suit small messages; for large ones src's link "
            "carries the whole tensor again in every round, where a pipelined chain has no "
            "rank send more than S.",
        3: "torch's sum of a bf16 tensor on the CPU accumulates in float32 and rounds to "
            "bf16 once, at the end. gloo's all_reduce rounds to bf16 after every addition of "
            "two ranks' values: 15 roundings for 16 ranks, whose errors add up.",
    },
    "11": {
        1: "Only rank 0 counts a monitored_barrier's timeout: the other ranks report "
            "to rank 0 and wait for its answer, and rank 0 names the ranks that are missing. "
            "Here rank 0 is stuck in all_reduce and never reaches the barrier, so nobody counts "
            "the 1 second. Ranks 1 to 3 wait as long as their process group's own timeout (30 "
            "minutes by default on gloo; 7 s on these ranks, which LocalGroup stops after 2 s), "
            "then each raises, in torch's words: \"Rank 1 successfully reached monitoredBarrier, "
            "but received errors while waiting for send/recv from rank 0. Please check rank 0 "
            "logs for faulty rank.\" That points at rank 0, but rank 0's log holds only its own "
            "all_reduce's timeout (\"Timed out waiting ... for recv operation to complete\"). So "
            "put a monitored_barrier where rank 0 is sure to arrive, such as the top of each "
            "training step while you hunt a hang.",
        2: "The fingerprint holds the collective, the sequence number and each tensor's "
            "shape, dtype and device, not the ReduceOp (CollectiveFingerPrint in torch's "
            "ProcessGroupWrapper.cpp). Every rank ran an all_reduce of 4 float32 numbers, so "
            "the fingerprints agree and the numbers come back silently wrong, as on plain "
            "gloo. Only a check of your own catches this one: all_gather the op, or the "
            "result.",
        3: "At the end, DDP's join hook broadcasts the final model from the highest-numbered "
            "rank of those that ran out of inputs last, here rank 1 "
            "(DistributedDataParallel._sync_final_model and _find_common_rank), so every rank "
            "holds the parameters of the third step, even ranks 2 and 3, which never took it. "
            "The optimizer is not part of the model, and nothing broadcasts its state: rank 3's "
            "Adam stepped twice, so its exp_avg averages two gradients, rank 0's three. The next "
            "epoch starts from equal weights but unequal moments, so the ranks' updates, and "
            "then their models, drift apart without an error. After an uneven epoch under Join, "
            "broadcast the optimizer state from one rank, or even the data out.",
    },
    "12": {
        1: "Rank 0 was killed by SIGABRT, with no Python exception to catch. gloo's "
            "all_gather (gloo/allgather.cc) passes each rank's piece around a ring in two "
            "halves, and rank 0 receives first from rank 2. It had room for half of its own 4 "
            "bytes, 2, and rank 2 sent half of its 12 bytes, 6: the receiving side's check "
            "(transport/tcp/pair.cc) fails, and a failed check in gloo's C++ code aborts the "
            "process. The other ranks raise once rank 0's connection closes, or return before "
            "they notice; which one depends on timing. Check the sizes before the collective, "
            "on every rank: step 2.",
        2: "3 ranks need a multiple of 3: 10 samples become 12 positions, and the sampler "
            "fills positions 10 and 11 with the first two samples of its list, 0 and 1. Rank "
            "r takes every third position from r: rank 2 takes positions 2, 5, 8 and 11, that "
            "is samples 2, 5, 8 and, at position 11, sample 1 a second time.",
        3: "297 = 3 x 99: on 3 ranks nothing is padded and the metric is exact. On 4 ranks "
            "the sampler pads to 300 and evaluates samples 0, 1 and 2 twice, so the accuracy "
            "and the loss move. You can tell without running it: the exact accuracy is 253 / "
            "297, and for (253 + c) / 300 to equal it, the c right answers among the 3 "
            "repeats would have to be 300 x 253 / 297 - 253 = 2.56, not a whole number. A "
            "padded metric depends on the world size: the same model on "
            "the same data reports different numbers on 3 and on 4 ranks (here a small "
            "difference, below the bound p / (N + p) = 1 %), which is enough to break a "
            "comparison across runs.",
        4: "Rank 0 shuffles with seed + 1, ranks 1 and 2 with seed + 0: they take their "
            "positions from two different orders, so their shares no longer fit together: "
            "some samples reach two ranks, and some none (here sample 0). Nothing raises, and "
            "every rank still gets 4 indices. Call set_epoch(epoch) on every rank, with the "
            "same epoch; the sampler's seed must be the same on every rank too (its docstring "
            "says so).",
    },
    "13": {
        1: "DDP's constructor broadcasts rank 0's parameters and buffers to every rank "
            "(_sync_module_states in torch/distributed/utils.py, called from "
            "DistributedDataParallel.__init__ in torch/nn/parallel/distributed.py): every "
            "tensor of named_parameters() and named_buffers(), a buffer registered with "
            "persistent=False too. A plain tensor attribute is neither a parameter nor a "
            "buffer, so DDP does not see it, and each rank keeps the value it drew.",
        2: "At the beginning of every forward in training DDP broadcasts rank 0's buffers, "
            "overwriting what the other ranks added; then each rank adds its own batch. What "
            "survives from one step to the next is rank 0's history: rank 0 holds 1.0, the "
            "mean of its own batches only, and rank r holds rank 0's history plus its own "
            "last batch, (4 x 1 + (r + 1)) / 5. No rank holds 2.5, the mean of the data.",
        3: "aux.weight and aux.bias got no gradient on any rank, and in this small model "
            "every parameter shares one gradient bucket. That bucket never became ready, so "
            "DDP never all-reduced it, and never queued the wait at the end of backward() "
            "(Reducer::mark_variable_ready queues it once the last bucket is launched): "
            "backward() returned with each rank's own, local gradient, and the optimizer "
            "stepped on it. Nothing raised. From here the four "
            "replicas differ. The error comes one step later, at the next forward.",
        4: "This is the first forward after the first backward, and with gradients enabled "
            "it rebuilds the gradient buckets: _rebuild_buckets broadcasts rank 0's new bucket "
            "order (an optional part counts these broadcasts), a collective only rank 0 runs, "
            "so rank 0 hangs, buffers or not. Under torch.no_grad() that forward "
            "rebuilds nothing, and without buffers it syncs none, so it runs no collective at "
            "all and returns. Whether a rank-0-only forward through the wrapper hangs depends "
            "on the model, the step and torch.no_grad(); model.module never runs a collective.",
    },
    "14": {
        1: "The squared 2-norm is a sum over elements, ‖g‖² = Σ g_i², and the two ranks hold "
            "different elements, so ‖g‖² = n₀² + n₁²: norms of disjoint pieces add as squares. "
            "So each rank all-reduces its n² with SUM, and every rank takes the square root of "
            "the sum: recipe 2. A sum of norms is too large, a maximum too small. An average "
            "of the squares, as DDP averages gradients, is ‖g‖² / 2: its square root is √2 "
            "times too small. A norm's squares are added, never averaged.",
        2: "The norm of each of the 4 Shard(0) gradients is a scalar DTensor with the placement "
            "_NormPartial(2): each rank holds the norm of its own rows, and the value is their "
            "reduction, (Σ local²)^½, not yet computed (the class _NormPartial, in "
            "torch/distributed/tensor/_ops/_math_ops.py). torch.stack of the 4 pending norms "
            "stays pending, with no collective. The norm of those norms could stay pending too, "
            "since norms of disjoint pieces add as squares (question 1), but torch 2.13 does not "
            "defer it: _NormPartial records its pending reduction as a sum (of squares), not a "
            "norm, and common_reduction_strategy, in the same file, completes a pending value "
            "whose reduction differs from the one it is about to run. So DTensor completes the "
            "stack first, once for all 4: local², an all_reduce, √, step 1's collective. "
            "CommDebugMode counted it: one all_reduce in the whole call, "
            "not one per gradient. total_norm comes out Replicate(): in torch "
            "2.13 every rank holds the whole norm, and the same clip factor. The returned norm was not always "
            "Replicate: pytorch/pytorch#126457 (May 2024) prints one with the placement "
            "_NormPartial, whose local value was 482.09 where full_tensor() gave 1052.59. A "
            "rank that read that local value saw the norm of its own shard, as #170862 and "
            "torchtitan#766 report. total_norm.full_tensor() is the whole norm in every "
            "version.",
        3: "torch.save pickles a DTensor as its local tensor, its placements and its mesh, and "
            "no rank sends rank 0 its rows: the file holds rank 0's shard of each DTensor, 8 "
            "of 0.weight's rows. Loaded elsewhere, it is a DTensor of global shape (32, 64) "
            "holding (8, 64), whose process group does not exist there.",
    },
    "15": {
        1: "Every rank stores ceil(10 / 4) = 3 rows, padding included, so the all_gather "
            "fills a buffer of 12 rows, 3 from each rank in rank order. FSDP2 takes its first "
            "10 rows as the parameter, so the padding can only lie at the end: ranks 0, 1 and "
            "2 hold rows 0 to 8, and rank 3 holds row 9, the 1 row left, then 2 rows of "
            "padding. With 3, 3, 2, 2, padding would sit after rows 7 and 9, and the first 10 "
            "rows of the buffer would not be the parameter. Shard(0) cuts rows as "
            "torch.chunk(param, n, dim=0) does: c = ceil(rows / n) rows per rank while rows "
            "last, so the last ranks may hold fewer, or none (_init_sharded_param in "
            "torch/distributed/fsdp/_fully_shard/_fsdp_param.py).",
        2: "With fully_shard on the root only, every parameter is in the root's one "
            "group, and for the root the default None means False: it keeps the gathered "
            "parameters after forward, because backward starts with them. So one all_gather "
            "before forward serves backward too, and one reduce_scatter averages every "
            "gradient. It sends the fewest bytes and holds the most gathered parameters: "
            "every parameter stays gathered from the start of forward to the end of "
            "backward, as in notebook 08's ZeRO-3.",
        3: "After FSDP2's reduce-scatter, rank 0's local gradient holds the first rows of "
            "each weight and rank 1's the last rows, both already averaged. all_reduce(AVG) "
            "of to_local() over the same ranks averages rank 0's rows with rank 1's rows: "
            "numbers of different parameters. Nothing fails, and the gradient is wrong. At 4 "
            "ranks the local shards of 2.weight even differ in size (3, 3, 3 and 1 rows, "
            "question 1), so that all_reduce would pair tensors of different lengths: a "
            "mismatched collective. With FSDP over dp, never reduce over dp again; sync only "
            "the dimensions FSDP does not cover (cp, in the page's example), where the ranks "
            "hold the same shard.",
    },
    "16": {
        1: lambda: (
            "DDP made 2 buckets. A bucket's all_reduce can start only once all of its gradients are "
            "ready; one bucket of every gradient would wait for the first layer's, the last one "
            "ready, and could not overlap backward() at all. "
            "So with the default bucket_cap_mb (None), DDP caps the first bucket at "
            f"dist._DEFAULT_FIRST_BUCKET_BYTES = {_first_bucket()} and the others at "
            "25 MiB (_BucketCapacityConfig in torch/nn/parallel/distributed.py): the first bucket "
            "holds the last layers, whose gradients are ready first, so that communication starts "
            "early. A bucket closes once it reaches its cap, so it may exceed it by one tensor (a "
            "maintainer explains both in pytorch/pytorch#48880, \"bucket_cap_mb not honored by "
            "AllReduce ops\")."),
        2: lambda held: (
            f"6e-8 is stored in fp16 as {held:.4g}: 2^-24, fp16's smallest subnormal number. "
            f"Divided by 4 it is {held / 4:.2g}, less than half of 2^-24, so every rank's share "
            "rounds to 0 before it is sent. The sum of 4 zeros is 0: the gradient vanishes. "
            f"Summing first keeps it: 4 x {held:.4g} is {round(4 * held / 2**-24)} times 2^-24, "
            f"which fp16 holds exactly, and divided by 4 it is {held:.4g} again (an optional "
            "part after the summary runs both orders for four values)."),
    },
    "17": {
        1: "full_tensor() all-gathers every rank's shard, so every rank gets the same tensor. "
            "But fully_shard broadcasts nothing: it cuts each parameter into world_size chunks "
            "along dim 0 and keeps chunk number rank (_init_sharded_param in "
            "torch/distributed/fsdp/_fully_shard/_fsdp_param.py). Each rank keeps its rows of "
            "the weight IT drew, so the whole is a patchwork: rows 0-1 from rank 0's "
            "initialisation, rows 2-3 from rank 1's, and so on. It is no rank's model, and "
            "nothing raises.",
        2: "A row is zero when its unit was dropped for all 4 samples. With one seed the 4 "
            "ranks drop the same units, so that happens with probability 1/2: about 32 of 64 "
            "rows. With a seed per rank a unit must be dropped on 4 ranks independently, "
            "(1/2)^4: about 4 of 64, what one process with 4 samples and a mask per sample "
            "gives. With one seed every step trains about half of the units on the whole "
            "global batch; with a seed per rank each sample gets a mask of its own, as in one "
            "process.",
        3: "Without dropout, torch.randperm is the first draw after the seed. With "
            "dropout, F.dropout first draws its mask from the same global generator, and "
            "every draw moves the generator on: randperm then starts from another state, so "
            "the order changes although the seed did not. Two purposes shared one stream.",
    },
    "18": {
        1: "The parameters used where a rank holds only its own tokens: both LayerNorms' "
            "weight and bias, and the two biases added after the reduce_scatter (o.bias, "
            "2.bias). A rank's gradient of each is a sum over its own tokens only: a partial "
            "sum, and the 4 ranks' partial sums add up to the right gradient. The column- and "
            "row-parallel weights see every token (after the all_gather), so theirs are "
            "right. Megatron-LM marks these parameters sequence_parallel and all-reduces "
            "their gradients over tp after backward "
            "(_allreduce_non_tensor_model_parallel_grads, formerly "
            "_allreduce_layernorm_grads, in "
            "megatron/core/distributed/finalize_model_grads.py).",
        2: "It runs without a word, because both tp shards have the same shape. But "
            "averaging over tp mixes the gradients of different parameters: rank (0, 0)'s "
            "rows 0-7 of W1 get the mean of rows 0-7 and rows 8-15. Only the replicated b2 "
            "survives, because its gradient is the same on both tp ranks.",
    },
}


def why(notebook: str, question: int, **values) -> str:
    """The explanation question ``question`` of notebook ``notebook`` reveals, as ``str``.

    Args:
        notebook: two digits, ``"01"`` to ``"18"``.
        question: the question's number (``answer_2`` is question 2).
        **values: what the question cell computed, for the entries that quote it
            (notebook 16, question 2: ``held``, the ``float`` fp16 holds for 2e-7).

    Raises:
        ValueError: no such notebook or question (the message names the valid ones), or
            values missing or given where the entry takes none.
    """
    if notebook not in WHY:
        raise ValueError(f"notebook must be one of {', '.join(WHY)}; got {notebook!r}")
    if question not in WHY[notebook]:
        raise ValueError(f"notebook {notebook} has questions "
                         f"{', '.join(map(str, WHY[notebook]))}; got {question!r}")
    entry = WHY[notebook][question]
    if isinstance(entry, str):
        if values:
            raise ValueError(f"question {question} of notebook {notebook} takes no values; "
                             f"got {', '.join(values)}")
        return entry
    try:
        return entry(**values)
    except TypeError as err:
        raise ValueError(f"question {question} of notebook {notebook}: {err}") from None
