"""stare_jax.sampling.engine, the rollout engine: continuous batching over a paged KV cache, with prefix sharing,
chunked prefill and multi-turn continuation. A drop-in for `Sampler` (same `generate_arrays` / `generate`
signatures and outputs).

The package, one concern per module (each readable alone):
- api.py: `Engine`, what callers use (generate / generate_arrays, start / extend / advance / close) -- thin: it
  validates, builds `Conversation`s and hands them to the scheduler; plus generate, make_generator,
  engine_unsupported, kv_bytes.
- scheduler.py: the host scheduler (`Scheduler`, `Conversation`, assign_shards): slots, page bookkeeping,
  admission, prefix sharing, refills, preemption, eviction -- plain Python, replicated on every process.
- programs.py: the jitted device programs (decode chunk, prefill, page copy; compiled_programs counts their
  compiles) and `Device`: the weights, the page pool and the layouts of the programs' inputs.
Draw options travel as one stare_jax.sampling.SamplingParams.

Design (host scheduler + three jitted programs):
- Slots. `max_slots` decode slots; a queue of (prompt, sample g) requests, prompt-major. Each round the host
  (1) admits queued requests into free slots, (2) runs one prefill program over every row that still has prompt
  (or appended) tokens to write -- at most `prefill_chunk` tokens per row per round, so a long prompt never
  stalls decoding for more than one chunk, (3) attaches rows whose shared prompt prefix is complete, (4) runs
  one decode program of up to `decode_chunk` (K) steps over the ready slots, then reads back the K tokens per
  slot and frees the slots (and pages) of rows that finished (EOS or their max_new_tokens). A finished row's
  slot is refilled in the next round. The decode program exits early when every slot is done.
- Pages. Per layer k/v [K, num_pages, page_size, Dh] (kv heads first: models.paged_attention.pool_shape; on a
  CPU the keys [K, num_pages, Dh, page_size]: paged_attention.keys_transposed) allocated once (page 0 = trash
  page for padding writes); host-side free list + reference counts (paged_kv.PagePool) and a per-row page
  table. Pages are allocated as a row grows (one chunk ahead) and returned when it ends, so memory scales with
  live tokens. Prefill attention gathers a row's first M pages, M a power-of-two bucket over the live rows
  (models/paged_attention.py); decode attention is
  `sampling.engine.attention`: the same gather path, or (auto on a TPU with head_dim % 128 == 0 and a bfloat16
  pool) jax's TPU Pallas paged-attention kernel, which reads the live pages in place (under jax.shard_map on a
  mesh: each device runs it on its data shard's pool and its kv heads).
- Prefix sharing. The G samples of a prompt share its prefix pages: the prompt minus its last token is
  prefilled ONCE into a prefix entry; each sample then shares the entry's full pages (reference counted) and
  gets a private copy of the partial last page (copy-on-write at attach time), so its first new token (and the
  last prompt token, fed by the first decode step) go to a slot-private page. No page is ever written by two
  rows. The entry is dropped once all G samples are attached.
- Randomness. Sample g of prompt p draws its token at response index i from
  uniform(fold_in(fold_in(fold_in(key(seed), p), g), i)) -- exactly the static Sampler's keys -- so the tokens
  do not depend on slot, max_slots, K, page layout or which other rows run (tests check all of these).
- Pages exhausted. Rows parked between turns (keep=True: a multi-turn row waiting on its tool call) give their
  pages first, the most recently parked first (`stats["evictions"]`); their next turn prefills the whole
  conversation again. Then a row that cannot grow preempts the most recently admitted decoding row (LIFO): its
  pages are freed and it goes back to the queue front; on re-admission it is recomputed (its whole conversation
  prefilled again; same draws, same tokens). A request that cannot fit an empty pool is a ValueError naming
  sampling.engine.num_pages and the value needed.
- Multi-turn. `start` keeps rows alive after their turn (`Conversation`); `extend` appends given tokens (a
  tool's output, loss mask 0, log-prob NaN) and continues sampling: only the new tokens are prefilled into the
  row's pages, the conversation is never re-prefilled. Both block until every turn ended, or with wait=False
  only queue the rows into the running batch (scheduler._Batch: the shards' scheduler state, kept between calls
  while rows are queued or decoding); `advance` then runs one round and returns the rows whose turn ended in it, and
  `extend(..., wait=False)` of some of them queues their next turn while the other rows keep decoding (the
  event-driven tool rollout: tools/rollout.py). A row whose turn ended gives its slot back at once (a row
  waiting on a tool call never holds a slot or masks a decode row) and keeps its pages (its continuation
  prefills only the appended tokens, unless a short pool evicted them). The rows of a batch share its
  SamplingParams; a blocking call on an engine with a running batch is refused; `close` of a running row cancels
  the batch (an error path).
- Weights. `update_params` reshards the trainer's parameters on device into the sampler layout (as Sampler);
  the page pool is allocated on the first call and reused (donated through every program) until `release`
  frees it with the weight copy before the train step; nothing recompiles across RL steps once the page-table
  width buckets of a workload have been seen.
- Mesh: parameters in the sampler layout, the pool's kv heads over the tensor axis. A mesh that splits the batch
  over D = batch_shards(mesh) data shards (its data / fsdp axes) gives each shard its own ceil(max_slots / D)
  slots and its own pool of ceil(num_pages / D) pages: the pool per layer is [D, K, N/D, P, Dh] (the leading axis
  over the batch axes, kv heads over tensor), page tables hold shard-local page ids, and D host sub-schedulers
  (scheduler._Shard: free list, queue, slots, prefix entries) each admit, grow, preempt and retire their own
  rows. Prompts go to shards whole (all G samples on one shard, so prefix pages are shared in one pool),
  balanced by token work. The programs run the one-shard body under jax.vmap(spmd_axis_name=the batch axes)
  over the shard axis: each device gathers and writes only its own pages (tests check the compiled programs
  have no all-gather of the pool). Every round every shard advances one program (a shard without work runs
  masked rows; rows are bucketed by the busiest shard); a decode chunk ends early once any shard can refill
  slots. Draws depend on (seed, prompt, g, step) only, so the tokens do not depend on the shard. One shard
  (D = 1) is the program without the shard axis.
- Multi-process (multi-host) runs: the host scheduler is replicated SPMD. Every process runs the same scheduler
  on the same host data (the prompts, the appended tool tokens) and so takes the same decisions (admission,
  pages, preemption, bucket shapes); the only cross-process data are device results. Every host input of a
  program (tokens, positions, page tables, budgets, copy lists, draw options) is built by every process from
  its identical host value with distributed.global_from_host (each process places its own devices' pieces:
  programs.Device.put / put_rows); the pool is a global array made in its sharding by a jitted program; the tokens,
  log-probs, counts and EOS flags of a decode chunk come back to every process in one distributed.fetch_global
  per chunk. Draws depend on (seed, prompt, g, step) only, so the tokens equal the single-process engine's
  (tests/system/test_multihost_engine.py: 2 processes x 4 devices == 1 x 8). `generate_arrays` returns arrays
  replicated over the mesh (global arrays that fetch_global reads on every process).
- Not yet: a Pallas prefill kernel (prefill gathers on every platform; over a context longer than two
  PREFILL_KEY_BLOCKs it attends one key block at a time, so its fp32 scores stay one block wide).
- Ahead of time: `Engine.trace_programs` traces the decode and prefill programs at their largest shapes on an
  abstract engine (models.abstract_model), for stare_jax.training.aot to compile for a TPU slice on a CPU host.
"""

from stare_jax.config.engine import EngineConfig
from stare_jax.sampling.engine.api import Engine, engine_unsupported, generate, kv_bytes, make_generator
from stare_jax.sampling.engine.programs import Device, compiled_programs
from stare_jax.sampling.engine.scheduler import Conversation, Scheduler, assign_shards

__all__ = [
    "Conversation",
    "Device",
    "Engine",
    "EngineConfig",
    "Scheduler",
    "assign_shards",
    "compiled_programs",
    "engine_unsupported",
    "generate",
    "kv_bytes",
    "make_generator",
]
