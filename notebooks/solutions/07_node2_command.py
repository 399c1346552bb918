# Solution to notebook 07, exercise: node 2 of 3 (8 GPUs each), static rendezvous at 10.0.0.5:29400.
node2_command = ("NCCL_SOCKET_IFNAME=eth1 "     # NCCL over the network the nodes share
                 "torchrun --nnodes 3 --node-rank 2 --nproc-per-node 8 "
                 "--master-addr 10.0.0.5 --master-port 29400 train.py")
node2_ranks = list(range(2 * 8, 3 * 8))    # RANK = node_rank * nproc_per_node + LOCAL_RANK
rank13_node_and_local_rank = divmod(13, 8)  # backwards: node rank 13 // 8, LOCAL_RANK 13 % 8
