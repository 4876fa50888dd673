"""Shared by several tests: moved from tests/integration/test_train.py (which imports them back)."""

# A very small toy: 2-layer d=32 model, 5 SFT steps, 8 prompts x 4 rollouts per RL step.
TINY = [
    "toy.hidden_size=32",
    "toy.num_layers=2",
    "toy.sft_steps=5",
    "toy.num_train=200",
    "toy.num_eval=8",
    "rl.train_batch_size=4",
    "rl.group_size=4",
    "rl.gen_batch_size=8",
    "rl.micro_batch_size=8",
    "rl.dynamic_sampling=false",
    "optimizer.lr=1e-3",
    "logging.eval_every_steps=2",
    "logging.tensorboard=false",
    "logging.progress_bar=false",
    "checkpoint.every_steps=1",
    "checkpoint.keep=10",
    "sampling.eval_num_samples=2",
]
