"""The embedded CPU default: toy prompts with many valid answers (tasks.digit_set by default, or tasks.digit_sum),
a SentencePiece tokenizer trained for them, and a tiny Qwen2-shaped transformer warm-started by a short SFT phase on
uniformly random answers, a fraction `sft_noise` of whose digits are replaced by random ones (so it starts with high
entropy and accuracy well below 1).

task tool_mul (`stare-jax demo --scenario tool`): the warm start is multi-turn - prompt, the model's
`<code>print(m*D)</code>` call, the interpreter's observation (loss mask 0: assistant-only loss, as in
stare_jax.training.sft's conversation SFT) and the copied answer. It is deliberately imperfect so RL has something to
gain:
a fraction `sft_direct_frac` of the examples answer with a guessed number without calling the tool, and a fraction
`sft_noise` of D's digits are replaced by random digits (1-9). The retool tags, the call's opener `<code>print(`
and the newline are user-defined pieces of the tokenizer (each closing tag is one stop token), and its tokenizer
adds no dummy-prefix piece, so a call `<code>print(37*54282)</code>` is k + 6 model tokens and most of what the
model writes is D's free digits and the copied product.

Everything is built once per asset config and cached under `cache_dir/<hash>/`, so both arms of the demo (GRPO-ds
and STARE) start from the very same checkpoint and data.

Layout of a prepared asset folder:
    train.jsonl, eval.jsonl     {id, problem, answer} rows (answer = the task's spec, e.g. 'K:DIGITS', read by its
                                score function); eval prompts use (k, set) specs never seen in training
    model/                      HF folder (config.json, model.safetensors) + tokenizer.model
    sft_log.jsonl               the warm-start loss curve (the RL run's metrics.jsonl stays RL-only)
    DONE                        written last: a folder without it is incomplete and rebuilt

The package is split by what each part needs: `spec` holds the toy's configuration and model architecture (plain
data, no training code: `stare-jax plan` and the ahead-of-time compile read it); `assets` builds the tokenizer, the
data and the warm start (it trains, so it sits above the training package) and turns a run config with
`toy.enabled` into the run's inputs (`assets.run_inputs`), which the entry points hand to the training loop.
"""
