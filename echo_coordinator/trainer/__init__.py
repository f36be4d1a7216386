"""The training swarm's learner. Only `learner`, `weights`, `evidence`, `grpo`, `sharded`, `shard_delta` and `worker` load torch; importing this
package, `samples` or `tensors` does not.

- `samples`      TrainSample and its one codec (msgpack), torch-free
- `grpo`         advantages and the GRPO + truncated-importance-sampling objective
- `learner`      `Trainer`: the model (LoRA or full), a step, logprobs and verification evidence
- `weights`      the Trainer's weights apart from training: published, held for a while, checkpointed
- `sharded`      FSDP2 (`sharding = "fsdp"`): the units, gathers for verification, sharded checkpoints
- `shard_delta`  sharded full mode: each update encoded where the shards live, never gathered
- `evidence`     verification's forward: shared prompts, several groups a pass, logits scored in slices
- `step_checks`  verification from a step's own forward (LoRA, staleness 0), torch-free to import
- `distributed`  the rank protocol: ranks, rank 0's channel, gradient sums, the agreement check
- `worker`       the loop a rank other than 0 runs
- `tensors`      safetensors on disk, micro-batches, handing freed memory back
"""
