# Solution to notebook 07, exercise: the torchrun command for node 1 of 2.
# Same rendezvous as node 0 (static, at the head node's address and port), same
# --nnodes and --nproc-per-node, same script; only --node-rank changes.
node1_command = ("torchrun --nnodes 2 --node-rank 1 --nproc-per-node 4 "
                 "--master-addr 10.0.0.1 --master-port 29500 train.py")
