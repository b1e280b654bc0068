# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown] tags=["en"]
# # B · From nano-vllm to this book
#
# **Goal.** This appendix is for the reader who holds upstream nano-vllm's files open. For every
# upstream file, class, function and field it gives this book's module and name and the chapter
# that explains it; then it lists every place where the two engines *behave* differently, with
# the reason and the chapter that shows it. The last section checks the map against the code.
#
# The map is taken at upstream's `main`, commit `bb823b3` of 2026-04-26: the version with chunked
# prefill and the stale-entry fix (`f64d821`), the one the line-by-line annotation of
# `sequence.py` and `scheduler.py` reads. The second article, a walk through the scheduler and
# the block manager with the vLLM paper's figures, quotes an earlier upstream, from before
# chunked prefill; a section after the differences covers what it shows.

# %% [markdown] tags=["zh"]
# # B · 从 nano-vllm 到本书
#
# **目标：** 本附录写给手边开着上游 nano-vllm 源码的读者。对上游的每个文件、类、函数和字段，它给出本书中对应的
# 模块和名字，以及讲解它的章节；然后列出两个引擎*行为*不同的每一处，并给出原因和展示它的章节。最后一节用代码
# 检查这张对照表。
#
# 对照的是上游 `main` 分支 2026-04-26 的提交 `bb823b3`：这个版本带有分块 prefill 和过期条目的修复（`f64d821`），
# 逐行注解 `sequence.py` 和 `scheduler.py` 的那篇文章读的也是它。第二篇文章借用 vLLM 论文的插图讲解调度器和块管理器，
# 它引用的是更早的、分块 prefill 出现之前的上游；行为差异之后有一节专门讲它展示的代码。

# %% [markdown] tags=["en"]
# ## How to read the tables
#
# One table per upstream file; the heading names the upstream file, then the module of ours that
# holds most of its names. In the column *this book*, a name is relative to that module
# (`Sequence.num_cached_tokens`), unless it starts from the package root
# (`engine.scheduler.Scheduler.schedule`, that is `nanovllm.engine.scheduler.Scheduler.schedule`);
# `=` means the same names, in our module; `./` marks a file of this repository; `—` means
# that nothing corresponds. A class's row covers its constructor. Rows whose upstream column is
# `—` list what this book adds in that place.

# %% [markdown] tags=["zh"]
# ## 怎样读这些表
#
# 上游每个文件一张表；标题先写上游文件，再写本书中容纳其大部分名字的模块。*本书*一列中的名字相对于这个模块
# （`Sequence.num_cached_tokens`），除非它从包的根写起（`engine.scheduler.Scheduler.schedule`，即
# `nanovllm.engine.scheduler.Scheduler.schedule`）；`=` 表示在本书的模块中名字完全相同；`./` 表示本仓库中的文件；
# `—` 表示没有对应的东西。类所在的那一行也涵盖它的构造函数。上游一列为 `—` 的行，列出本书在这个位置新增的内容。

# %% [markdown] tags=["en"]
# ## Names

# %% [markdown] tags=["zh"]
# ## 名字对照

# %% [markdown] tags=["en"]
# ### `nanovllm/sampling_params.py` → `nanovllm/sampling_params.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `SamplingParams` | = | 01 | frozen; a bad value raises `TypeError` or `ValueError` naming the field |
# | `SamplingParams.temperature` | = | 01, 08 | `0` means greedy; upstream refuses it |
# | `SamplingParams.max_tokens`, `SamplingParams.ignore_eos` | = | 01 | same |
# | `SamplingParams.__post_init__` | = | 01 | checks every field; upstream only asserts `temperature > 1e-10` |
# | — | `SamplingParams.top_k`, `SamplingParams.top_p`, `SamplingParams.seed`, `SamplingParams.greedy` | 01, 08 | new: top-k, top-p, a per-request seed |
# | — | `SamplingParams.n` | 01, 05 | new: several samples of one prompt (parallel sampling) |

# %% [markdown] tags=["zh"]
# ### `nanovllm/sampling_params.py` → `nanovllm/sampling_params.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `SamplingParams` | = | 01 | 不可变；错误的取值抛出 `TypeError` 或 `ValueError`，并指明是哪个字段 |
# | `SamplingParams.temperature` | = | 01, 08 | `0` 表示贪心解码；上游不接受 0 |
# | `SamplingParams.max_tokens`, `SamplingParams.ignore_eos` | = | 01 | 相同 |
# | `SamplingParams.__post_init__` | = | 01 | 检查每个字段；上游只断言 `temperature > 1e-10` |
# | — | `SamplingParams.top_k`, `SamplingParams.top_p`, `SamplingParams.seed`, `SamplingParams.greedy` | 01, 08 | 新增：top-k、top-p、按请求设置的种子 |
# | — | `SamplingParams.n` | 01, 05 | 新增：一个提示词采样多个结果（并行采样） |

# %% [markdown] tags=["en"]
# ### `nanovllm/engine/sequence.py` → `nanovllm/engine/sequence.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `SequenceStatus`, `SequenceStatus.WAITING`, `SequenceStatus.RUNNING`, `SequenceStatus.FINISHED` | = | 01 | the same three states |
# | `Sequence` | = | 01 | `block_size` is a required keyword argument |
# | `Sequence.block_size` | = | 01, 16 | a field of each sequence that travels in its pickle; upstream's is a class attribute that `LLMEngine` sets in the driver process only |
# | `Sequence.counter` | `Sequence._ids` | 01 | the id counter |
# | `Sequence.seq_id`, `Sequence.token_ids`, `Sequence.num_tokens`, `Sequence.num_prompt_tokens`, `Sequence.num_cached_tokens`, `Sequence.num_scheduled_tokens`, `Sequence.block_table` | = | 01 | same meaning |
# | `Sequence.status` | `Sequence.status`, `Sequence.ALLOWED_TRANSITIONS` | 01 | a property whose setter refuses a move the state diagram does not have |
# | `Sequence.last_token` | = | 01 | a property reading `token_ids`, not a second copy |
# | `Sequence.is_prefill` | `engine.scheduler.Scheduler.schedule`, `Sequence.num_cached_tokens` | 04 | gone: a whole step is prefill or decode (`schedule` returns the flag), and a sequence still has prompt to compute while `num_cached_tokens < len(seq)` |
# | `Sequence.temperature`, `Sequence.max_tokens`, `Sequence.ignore_eos` | `Sequence.sampling_params` | 01, 16 | the whole `SamplingParams` is kept (`None` on a worker's slim copy) |
# | `Sequence.__len__`, `Sequence.is_finished`, `Sequence.num_completion_tokens`, `Sequence.prompt_token_ids`, `Sequence.completion_token_ids`, `Sequence.num_blocks`, `Sequence.last_block_num_tokens`, `Sequence.block`, `Sequence.append_token` | = | 01 | same |
# | `Sequence.__getitem__` | `Sequence.token_ids`, `Sequence.scheduled_token_ids` | 01, 16 | no indexing: a slim copy holds only the tail of the tokens (`first_token_index` says where it starts) |
# | `Sequence.__getstate__`, `Sequence.__setstate__` | = | 16 | ships the tokens whose KV is not cached yet, with `block_size`, id and status; upstream ships all tokens during prefill and the last one during decode |
# | — | `Sequence.append_pending_token`, `Sequence.set_token`, `Sequence.truncate`, `PENDING_TOKEN` | 18 | new: tokens still being computed (asynchronous scheduling) |
# | — | `Sequence.fork`, `Sequence.request_id`, `Sequence.sample_index`, `Sequence.pending_forks`, `Sequence.blocks_to_copy`, `sibling_samples` | 05 | new: a request's samples as sibling sequences, and the copy-on-write copies of a step |

# %% [markdown] tags=["zh"]
# ### `nanovllm/engine/sequence.py` → `nanovllm/engine/sequence.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `SequenceStatus`, `SequenceStatus.WAITING`, `SequenceStatus.RUNNING`, `SequenceStatus.FINISHED` | = | 01 | 同样的三个状态 |
# | `Sequence` | = | 01 | `block_size` 是必须给出的关键字参数 |
# | `Sequence.block_size` | = | 01, 16 | 每个序列自己的字段，随序列化数据一起传送；上游的是类属性，只在驱动进程里由 `LLMEngine` 设置 |
# | `Sequence.counter` | `Sequence._ids` | 01 | 序列编号计数器 |
# | `Sequence.seq_id`, `Sequence.token_ids`, `Sequence.num_tokens`, `Sequence.num_prompt_tokens`, `Sequence.num_cached_tokens`, `Sequence.num_scheduled_tokens`, `Sequence.block_table` | = | 01 | 含义相同 |
# | `Sequence.status` | `Sequence.status`, `Sequence.ALLOWED_TRANSITIONS` | 01 | 一个属性，它的 setter 拒绝状态图里没有的转换 |
# | `Sequence.last_token` | = | 01 | 读取 `token_ids` 的属性，而不是另存一份 |
# | `Sequence.is_prefill` | `engine.scheduler.Scheduler.schedule`, `Sequence.num_cached_tokens` | 04 | 去掉了：一整步要么是 prefill 要么是 decode（由 `schedule` 返回这个标志）；序列在 `num_cached_tokens < len(seq)` 时还有提示词要算 |
# | `Sequence.temperature`, `Sequence.max_tokens`, `Sequence.ignore_eos` | `Sequence.sampling_params` | 01, 16 | 保留整个 `SamplingParams`（工作进程收到的精简副本上为 `None`） |
# | `Sequence.__len__`, `Sequence.is_finished`, `Sequence.num_completion_tokens`, `Sequence.prompt_token_ids`, `Sequence.completion_token_ids`, `Sequence.num_blocks`, `Sequence.last_block_num_tokens`, `Sequence.block`, `Sequence.append_token` | = | 01 | 相同 |
# | `Sequence.__getitem__` | `Sequence.token_ids`, `Sequence.scheduled_token_ids` | 01, 16 | 不支持下标访问：精简副本只带着 token 的尾部（`first_token_index` 记录它从哪里开始） |
# | `Sequence.__getstate__`, `Sequence.__setstate__` | = | 16 | 传送 KV 尚未缓存的 token，连同 `block_size`、编号和状态；上游在 prefill 时传送全部 token，decode 时只传最后一个 |
# | — | `Sequence.append_pending_token`, `Sequence.set_token`, `Sequence.truncate`, `PENDING_TOKEN` | 18 | 新增：尚在计算中的 token（异步调度） |
# | — | `Sequence.fork`, `Sequence.request_id`, `Sequence.sample_index`, `Sequence.pending_forks`, `Sequence.blocks_to_copy`, `sibling_samples` | 05 | 新增：把一个请求的各个样本表示为兄弟序列，以及一步中写时复制要拷贝的块 |

# %% [markdown] tags=["en"]
# ### `nanovllm/engine/block_manager.py` → `nanovllm/engine/block_manager.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `Block` | = | 02 | same |
# | `Block.block_id`, `Block.ref_count`, `Block.hash`, `Block.token_ids` | = | 02, 03 | same |
# | `Block.update` | `engine.prefix_cache.PrefixCache.publish` | 03 | publication sets `hash` and `token_ids` |
# | `Block.reset` | = | 03 | forgets the contents only; `take_free_block` sets the count to 1 |
# | `BlockManager` | `BlockManager`, `BlockPool` | 02 | split in two: the pool knows blocks, the manager knows sequences |
# | `BlockManager.block_size`, `BlockManager.blocks`, `BlockManager.free_block_ids`, `BlockManager.used_block_ids` | `BlockPool.block_size`, `BlockPool.blocks`, `BlockPool.free_block_ids`, `BlockPool.used_block_ids` | 02 | same |
# | `BlockManager.hash_to_block_id` | `engine.prefix_cache.PrefixCache.hash_to_block_id`, `BlockPool.hash_to_block_id` | 03 | owned by the prefix cache; the pool shows it read-only |
# | `BlockManager.compute_hash` | `engine.prefix_cache.block_hash` | 03 | the same chained xxHash64, the same digests (checked below) |
# | `BlockManager._allocate_block` | `BlockPool.take_free_block`, `engine.prefix_cache.PrefixCache.forget` | 02, 03 | the stale-entry check lives in `forget` |
# | `BlockManager._deallocate_block` | `BlockPool.release` | 02 | drops one reference; at zero the block joins the free list's tail |
# | `BlockManager.can_allocate` | = | 02, 03 | returns a bool; upstream returns the number of cached blocks, or -1 |
# | `BlockManager.allocate` | `BlockManager.allocate`, `engine.prefix_cache.PrefixCache.match`, `BlockPool.hold` | 02, 03 | `allocate(seq)` finds the cache hits itself; upstream passes in the count from `can_allocate` |
# | `BlockManager.deallocate` | = | 02, 05 | same, last block first |
# | `BlockManager.can_append`, `BlockManager.may_append` | = | 02, 05 | a block is added when the table stops covering `len(seq)`; upstream tests `len(seq) % block_size == 1`, the same unless `block_size` is 1 |
# | `BlockManager.hash_blocks` | `BlockManager.publish_full_blocks`, `engine.prefix_cache.PrefixCache.publish` | 03 | called by postprocess once the step has written the KV, as upstream does |
# | — | `BlockManager.fork`, `engine.model_runner.copy_kv_blocks` | 05, 09 | new: siblings share their blocks; `may_append` gives a writer of a shared block its own copy |

# %% [markdown] tags=["zh"]
# ### `nanovllm/engine/block_manager.py` → `nanovllm/engine/block_manager.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `Block` | = | 02 | 相同 |
# | `Block.block_id`, `Block.ref_count`, `Block.hash`, `Block.token_ids` | = | 02, 03 | 相同 |
# | `Block.update` | `engine.prefix_cache.PrefixCache.publish` | 03 | 发布时设置 `hash` 和 `token_ids` |
# | `Block.reset` | = | 03 | 只清除内容；引用计数由 `take_free_block` 设为 1 |
# | `BlockManager` | `BlockManager`, `BlockPool` | 02 | 拆成两层：块池只认识块，块管理器认识序列 |
# | `BlockManager.block_size`, `BlockManager.blocks`, `BlockManager.free_block_ids`, `BlockManager.used_block_ids` | `BlockPool.block_size`, `BlockPool.blocks`, `BlockPool.free_block_ids`, `BlockPool.used_block_ids` | 02 | 相同 |
# | `BlockManager.hash_to_block_id` | `engine.prefix_cache.PrefixCache.hash_to_block_id`, `BlockPool.hash_to_block_id` | 03 | 归前缀缓存所有；块池只提供只读视图 |
# | `BlockManager.compute_hash` | `engine.prefix_cache.block_hash` | 03 | 同样的链式 xxHash64，摘要完全相同（见下文的检查） |
# | `BlockManager._allocate_block` | `BlockPool.take_free_block`, `engine.prefix_cache.PrefixCache.forget` | 02, 03 | 过期条目的检查在 `forget` 里 |
# | `BlockManager._deallocate_block` | `BlockPool.release` | 02 | 去掉一个引用；降到零时块排到空闲队列队尾 |
# | `BlockManager.can_allocate` | = | 02, 03 | 返回布尔值；上游返回命中的块数，或 -1 |
# | `BlockManager.allocate` | `BlockManager.allocate`, `engine.prefix_cache.PrefixCache.match`, `BlockPool.hold` | 02, 03 | `allocate(seq)` 自己查找缓存命中；上游要传入 `can_allocate` 得到的块数 |
# | `BlockManager.deallocate` | = | 02, 05 | 相同，从最后一块开始释放 |
# | `BlockManager.can_append`, `BlockManager.may_append` | = | 02, 05 | 块表不再覆盖 `len(seq)` 时加一块；上游判断 `len(seq) % block_size == 1`，除非 `block_size` 为 1，两者等价 |
# | `BlockManager.hash_blocks` | `BlockManager.publish_full_blocks`, `engine.prefix_cache.PrefixCache.publish` | 03 | 和上游一样，在这一步写完 KV 之后由后处理调用 |
# | — | `BlockManager.fork`, `engine.model_runner.copy_kv_blocks` | 05, 09 | 新增：兄弟序列共享块；要写入共享块的序列由 `may_append` 给它一份自己的副本 |

# %% [markdown] tags=["en"]
# ### `nanovllm/engine/scheduler.py` → `nanovllm/engine/scheduler.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `Scheduler` | = | 04 | keyword settings instead of a `Config` |
# | `Scheduler.max_num_seqs`, `Scheduler.max_num_batched_tokens`, `Scheduler.block_manager`, `Scheduler.waiting`, `Scheduler.running` | = | 04 | same |
# | `Scheduler.eos` | `Scheduler.eos_token_ids` | 04, 09 | a set: every end-of-sequence id the model declares |
# | `Scheduler.block_size` | `engine.block_manager.BlockPool.block_size` | 04 | read from the block manager |
# | `Scheduler.is_finished` | = | 04 | same |
# | `Scheduler.add` | `Scheduler.add`, `Scheduler.check_fits`, `Sequence.max_kv_tokens` | 04 | `check_fits` refuses a request that could never fit the cache (the admission check, run once where a request enters) |
# | `Scheduler.schedule` | `Scheduler.schedule`, `Scheduler._schedule_prefill`, `Scheduler._schedule_decode` | 04 | chunks whichever sequence runs out the budget; decode is capped by the token budget too |
# | `Scheduler.preempt` | `Scheduler._preempt` | 04 | same |
# | `Scheduler.postprocess` | `Scheduler.postprocess`, `Scheduler.advance`, `Scheduler.resolve` | 04, 05, 18 | two halves that asynchronous scheduling calls one step apart; returns the finished sequences |
# | — | `Scheduler.rollback`, `Scheduler.abort`, `Scheduler.observer` | 04, 20, A | new: undo a step that failed, drop a request, watch the scheduler |
# | — | `Scheduler._fork_siblings` | 05 | new: a request forks when its first token is sampled |

# %% [markdown] tags=["zh"]
# ### `nanovllm/engine/scheduler.py` → `nanovllm/engine/scheduler.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `Scheduler` | = | 04 | 用关键字参数配置，而不是传入 `Config` |
# | `Scheduler.max_num_seqs`, `Scheduler.max_num_batched_tokens`, `Scheduler.block_manager`, `Scheduler.waiting`, `Scheduler.running` | = | 04 | 相同 |
# | `Scheduler.eos` | `Scheduler.eos_token_ids` | 04, 09 | 一个集合：模型声明的每一个结束符 id |
# | `Scheduler.block_size` | `engine.block_manager.BlockPool.block_size` | 04 | 从块管理器读取 |
# | `Scheduler.is_finished` | = | 04 | 相同 |
# | `Scheduler.add` | `Scheduler.add`, `Scheduler.check_fits`, `Sequence.max_kv_tokens` | 04 | `check_fits` 拒绝永远放不进缓存的请求（准入检查，在请求进入的地方只运行一次） |
# | `Scheduler.schedule` | `Scheduler.schedule`, `Scheduler._schedule_prefill`, `Scheduler._schedule_decode` | 04 | 哪个序列用完预算就把哪个分块；decode 同样受 token 预算限制 |
# | `Scheduler.preempt` | `Scheduler._preempt` | 04 | 相同 |
# | `Scheduler.postprocess` | `Scheduler.postprocess`, `Scheduler.advance`, `Scheduler.resolve` | 04, 05, 18 | 分成两半，异步调度时相隔一步调用；返回已结束的序列 |
# | — | `Scheduler.rollback`, `Scheduler.abort`, `Scheduler.observer` | 04, 20, A | 新增：撤销失败的一步、丢弃一个请求、观察调度器 |
# | — | `Scheduler._fork_siblings` | 05 | 新增：请求在采样出第一个 token 时分叉 |

# %% [markdown] tags=["en"]
# ### `nanovllm/layers/activation.py` → `nanovllm/layers/activation.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `SiluAndMul`, `SiluAndMul.forward` | `SiluAndMul`, `SiluAndMul.forward`, `SiluAndMul.op`, `silu_and_mul` | 06, 14 | plain PyTorch in `silu_and_mul`; on a GPU chapter 14 hands the layer a compiled version (`op`) |

# %% [markdown] tags=["zh"]
# ### `nanovllm/layers/activation.py` → `nanovllm/layers/activation.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `SiluAndMul`, `SiluAndMul.forward` | `SiluAndMul`, `SiluAndMul.forward`, `SiluAndMul.op`, `silu_and_mul` | 06, 14 | 纯 PyTorch，写在 `silu_and_mul` 里；在 GPU 上由第 14 章把编译后的版本交给这一层（`op`） |

# %% [markdown] tags=["en"]
# ### `nanovllm/layers/layernorm.py` → `nanovllm/layers/layernorm.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `RMSNorm`, `RMSNorm.eps`, `RMSNorm.weight`, `RMSNorm.forward` | = | 06 | same interface, one difference of precision: we add the residual in the model's dtype and normalize that rounded sum, as `transformers` does; upstream adds in float32 and normalizes the float32 sum (in bf16 the normalized output can differ in its last bits; see the differences below) |
# | `RMSNorm.rms_forward`, `RMSNorm.add_rms_forward` | `rms_norm`, `RMSNorm.op` | 06, 14 | one function, with and without the residual; on a GPU chapter 14 hands each norm a compiled version (`op`) |

# %% [markdown] tags=["zh"]
# ### `nanovllm/layers/layernorm.py` → `nanovllm/layers/layernorm.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `RMSNorm`, `RMSNorm.eps`, `RMSNorm.weight`, `RMSNorm.forward` | = | 06 | 接口相同，精度有一处不同：我们按模型的数据类型加上残差，再对这个舍入后的和做归一化，与 `transformers` 一致；上游在 float32 下相加，并对 float32 的和做归一化（bf16 下归一化的输出在最后几位上可能不同；见下面的行为差异） |
# | `RMSNorm.rms_forward`, `RMSNorm.add_rms_forward` | `rms_norm`, `RMSNorm.op` | 06, 14 | 带与不带残差的同一个函数；在 GPU 上由第 14 章把编译后的版本交给每个归一化层（`op`） |

# %% [markdown] tags=["en"]
# ### `nanovllm/layers/rotary_embedding.py` → `nanovllm/layers/rotary_embedding.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `apply_rotary_emb` | `apply_rotary` | 06 | same rotation (NeoX layout) |
# | `RotaryEmbedding`, `RotaryEmbedding.head_size`, `RotaryEmbedding.cos_sin_cache`, `RotaryEmbedding.forward` | `RotaryEmbedding`, `RotaryEmbedding.head_size`, `RotaryEmbedding.cos_sin_cache`, `RotaryEmbedding.forward`, `RotaryEmbedding.op`, `rotary` | 06, 14 | adds `linear` and `llama3` scaling; the maths is `rotary`, compiled on a GPU (`op`, chapter 14) |
# | `get_rope` | `get_rope`, `rope_settings` | 06 | not cached by `lru_cache`: a model builds one and its layers share it |

# %% [markdown] tags=["zh"]
# ### `nanovllm/layers/rotary_embedding.py` → `nanovllm/layers/rotary_embedding.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `apply_rotary_emb` | `apply_rotary` | 06 | 同样的旋转（NeoX 布局） |
# | `RotaryEmbedding`, `RotaryEmbedding.head_size`, `RotaryEmbedding.cos_sin_cache`, `RotaryEmbedding.forward` | `RotaryEmbedding`, `RotaryEmbedding.head_size`, `RotaryEmbedding.cos_sin_cache`, `RotaryEmbedding.forward`, `RotaryEmbedding.op`, `rotary` | 06, 14 | 新增 `linear` 与 `llama3` 缩放；数学在 `rotary` 里，GPU 上会被编译（`op`，第 14 章） |
# | `get_rope` | `get_rope`, `rope_settings` | 06 | 没有用 `lru_cache` 缓存：模型构建一个，各层共用 |

# %% [markdown] tags=["en"]
# ### `nanovllm/layers/attention.py` → `nanovllm/layers/attention.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `store_kvcache_kernel`, `store_kvcache` | `layers.triton_attention.store_kvcache_kernel`, `layers.triton_attention.store_kvcache`, `TorchBackend.store_kvcache` | 07, 11 | our own Triton kernel, and a plain-torch store for the CPU; both skip slot `-1`, as upstream's kernel does |
# | `Attention`, `Attention.num_heads`, `Attention.head_dim`, `Attention.scale`, `Attention.num_kv_heads`, `Attention.k_cache`, `Attention.v_cache` | = | 06, 07 | same (chapter 06's first cut attends over one sequence, without a cache) |
# | `Attention.forward` | `Attention.forward`, `Attention.backend`, `attention_backend` | 06, 07, 11 | hands the math to the backend object the model runner gives every layer: `torch` (reference, CPU), `triton` (GPU), `flash-attn` (FlashAttention 4, verified on the H200) |

# %% [markdown] tags=["zh"]
# ### `nanovllm/layers/attention.py` → `nanovllm/layers/attention.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `store_kvcache_kernel`, `store_kvcache` | `layers.triton_attention.store_kvcache_kernel`, `layers.triton_attention.store_kvcache`, `TorchBackend.store_kvcache` | 07, 11 | 我们自己的 Triton 内核，以及供 CPU 使用的纯 torch 写入；两者都跳过槽位 `-1`，与上游的内核一样 |
# | `Attention`, `Attention.num_heads`, `Attention.head_dim`, `Attention.scale`, `Attention.num_kv_heads`, `Attention.k_cache`, `Attention.v_cache` | = | 06, 07 | 相同（第 06 章的第一版只对一个序列计算注意力，没有缓存） |
# | `Attention.forward` | `Attention.forward`, `Attention.backend`, `attention_backend` | 06, 07, 11 | 把计算交给模型执行器发给每一层的后端对象：`torch`（参考实现，CPU）、`triton`（GPU）、`flash-attn`（FlashAttention 4，已在 H200 上验证） |

# %% [markdown] tags=["en"]
# ### `nanovllm/layers/embed_head.py` → `nanovllm/layers/embed_head.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `VocabParallelEmbedding`, `VocabParallelEmbedding.tp_rank`, `VocabParallelEmbedding.tp_size`, `VocabParallelEmbedding.num_embeddings`, `VocabParallelEmbedding.num_embeddings_per_partition`, `VocabParallelEmbedding.vocab_start_idx`, `VocabParallelEmbedding.vocab_end_idx`, `VocabParallelEmbedding.weight` | = | 06, 16 | same |
# | `VocabParallelEmbedding.weight_loader`, `VocabParallelEmbedding.forward` | `VocabParallelEmbedding.weight_loader`, `VocabParallelEmbedding.forward`, `VocabParallelEmbedding.forward_local`, `VocabParallelEmbedding.sum_over_ranks` | 06, 16 | the loader checks the shape; `forward_local` is the part before the all-reduce, `sum_over_ranks` the all-reduce (a hook that returns its input until chapter 16) |
# | `ParallelLMHead`, `ParallelLMHead.forward` | `ParallelLMHead`, `ParallelLMHead.forward`, `ParallelLMHead.forward_local`, `ParallelLMHead.sampled_rows`, `ParallelLMHead.gather_slices` | 06, 07, 16 | same: the last token of each sequence during prefill (`sampled_rows`, 06), slices gathered on rank 0 (`gather_slices`, 10) |

# %% [markdown] tags=["zh"]
# ### `nanovllm/layers/embed_head.py` → `nanovllm/layers/embed_head.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `VocabParallelEmbedding`, `VocabParallelEmbedding.tp_rank`, `VocabParallelEmbedding.tp_size`, `VocabParallelEmbedding.num_embeddings`, `VocabParallelEmbedding.num_embeddings_per_partition`, `VocabParallelEmbedding.vocab_start_idx`, `VocabParallelEmbedding.vocab_end_idx`, `VocabParallelEmbedding.weight` | = | 06, 16 | 相同 |
# | `VocabParallelEmbedding.weight_loader`, `VocabParallelEmbedding.forward` | `VocabParallelEmbedding.weight_loader`, `VocabParallelEmbedding.forward`, `VocabParallelEmbedding.forward_local`, `VocabParallelEmbedding.sum_over_ranks` | 06, 16 | 加载器会检查形状；`forward_local` 是 all-reduce 之前的那部分，`sum_over_ranks` 就是 all-reduce（第 16 章之前，这个接缝原样返回输入） |
# | `ParallelLMHead`, `ParallelLMHead.forward` | `ParallelLMHead`, `ParallelLMHead.forward`, `ParallelLMHead.forward_local`, `ParallelLMHead.sampled_rows`, `ParallelLMHead.gather_slices` | 06, 07, 16 | 相同：prefill 时每个序列只取最后一个 token（`sampled_rows`，第 07 章），各分片在 rank 0 上 gather（`gather_slices`，第 16 章） |

# %% [markdown] tags=["en"]
# ### `nanovllm/layers/linear.py` → `nanovllm/layers/linear.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `divide` | = | 06 | raises a `ValueError` naming what does not split |
# | `LinearBase`, `LinearBase.tp_dim`, `LinearBase.tp_rank`, `LinearBase.tp_size`, `LinearBase.weight`, `LinearBase.bias`, `LinearBase.forward` | `LinearBase`, `LinearBase.tp_dim`, `LinearBase.tp_rank`, `LinearBase.tp_size`, `LinearBase.weight`, `LinearBase.bias`, `LinearBase.forward`, `tp_world`, `process_world` | 06, 16 | rank and size come from `tp_world` (explicit, or `process_world`: `torch.distributed` from chapter 16, else 1 process) |
# | `ReplicatedLinear`, `ReplicatedLinear.weight_loader`, `ReplicatedLinear.forward`, `ColumnParallelLinear`, `ColumnParallelLinear.weight_loader`, `ColumnParallelLinear.forward`, `RowParallelLinear`, `RowParallelLinear.weight_loader`, `RowParallelLinear.forward` | `ReplicatedLinear`, `ReplicatedLinear.weight_loader`, `ReplicatedLinear.forward`, `ColumnParallelLinear`, `ColumnParallelLinear.weight_loader`, `ColumnParallelLinear.forward`, `RowParallelLinear`, `RowParallelLinear.weight_loader`, `RowParallelLinear.forward`, `copy_checked` | 06, 16 | same split; every loader refuses a shape that does not fit (`copy_checked`) |
# | `MergedColumnParallelLinear`, `MergedColumnParallelLinear.output_sizes`, `MergedColumnParallelLinear.weight_loader` | = | 06, 16 | same |
# | `QKVParallelLinear`, `QKVParallelLinear.head_size`, `QKVParallelLinear.num_heads`, `QKVParallelLinear.num_kv_heads`, `QKVParallelLinear.weight_loader` | = | 06, 16 | same |
# | — | `agree_min`, `share_from_rank0` | 16 | new: the ranks agree on the KV block count; every rank gets rank 0's samples on its device |

# %% [markdown] tags=["zh"]
# ### `nanovllm/layers/linear.py` → `nanovllm/layers/linear.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `divide` | = | 06 | 抛出 `ValueError`，指明哪个量不能整除 |
# | `LinearBase`, `LinearBase.tp_dim`, `LinearBase.tp_rank`, `LinearBase.tp_size`, `LinearBase.weight`, `LinearBase.bias`, `LinearBase.forward` | `LinearBase`, `LinearBase.tp_dim`, `LinearBase.tp_rank`, `LinearBase.tp_size`, `LinearBase.weight`, `LinearBase.bias`, `LinearBase.forward`, `tp_world`, `process_world` | 06, 16 | rank 与进程数来自 `tp_world`（显式给出，或 `process_world`：第 16 章起问 `torch.distributed`，否则单进程） |
# | `ReplicatedLinear`, `ReplicatedLinear.weight_loader`, `ReplicatedLinear.forward`, `ColumnParallelLinear`, `ColumnParallelLinear.weight_loader`, `ColumnParallelLinear.forward`, `RowParallelLinear`, `RowParallelLinear.weight_loader`, `RowParallelLinear.forward` | `ReplicatedLinear`, `ReplicatedLinear.weight_loader`, `ReplicatedLinear.forward`, `ColumnParallelLinear`, `ColumnParallelLinear.weight_loader`, `ColumnParallelLinear.forward`, `RowParallelLinear`, `RowParallelLinear.weight_loader`, `RowParallelLinear.forward`, `copy_checked` | 06, 16 | 切分方式相同；每个加载器都拒绝形状不符的张量（`copy_checked`） |
# | `MergedColumnParallelLinear`, `MergedColumnParallelLinear.output_sizes`, `MergedColumnParallelLinear.weight_loader` | = | 06, 16 | 相同 |
# | `QKVParallelLinear`, `QKVParallelLinear.head_size`, `QKVParallelLinear.num_heads`, `QKVParallelLinear.num_kv_heads`, `QKVParallelLinear.weight_loader` | = | 06, 16 | 相同 |
# | — | `agree_min`, `share_from_rank0` | 16 | 新增：各 rank 就 KV 块数达成一致；每个 rank 在自己的设备上得到 rank 0 的采样结果 |

# %% [markdown] tags=["en"]
# ### `nanovllm/layers/sampler.py` → `nanovllm/layers/sampler.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `Sampler`, `Sampler.forward` | `Sampler`, `Sampler.forward`, `temperature_sample`, `sampling_inputs` | 08 | the same exponential race, plus greedy rows, top-k, top-p and seeds |

# %% [markdown] tags=["zh"]
# ### `nanovllm/layers/sampler.py` → `nanovllm/layers/sampler.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `Sampler`, `Sampler.forward` | `Sampler`, `Sampler.forward`, `temperature_sample`, `sampling_inputs` | 08 | 同样的指数赛跑，另加贪心行、top-k、top-p 和种子 |

# %% [markdown] tags=["en"]
# ### `nanovllm/models/qwen3.py` → `nanovllm/models/qwen3.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `Qwen3Attention`, `Qwen3Attention.num_heads`, `Qwen3Attention.num_kv_heads`, `Qwen3Attention.head_dim`, `Qwen3Attention.q_size`, `Qwen3Attention.kv_size`, `Qwen3Attention.qkv_proj`, `Qwen3Attention.o_proj`, `Qwen3Attention.rotary_emb`, `Qwen3Attention.attn`, `Qwen3Attention.q_norm`, `Qwen3Attention.k_norm`, `Qwen3Attention.forward` | `Qwen3Attention`, `Qwen3Attention.num_heads`, `Qwen3Attention.num_kv_heads`, `Qwen3Attention.head_dim`, `Qwen3Attention.q_size`, `Qwen3Attention.kv_size`, `Qwen3Attention.qkv_proj`, `Qwen3Attention.o_proj`, `Qwen3Attention.rotary_emb`, `Qwen3Attention.attn`, `Qwen3Attention.q_norm`, `Qwen3Attention.k_norm`, `Qwen3Attention.forward`, `Qwen3Attention.norm_and_rotate` | 06 | same; the rotary table is shared by all layers |
# | `Qwen3Attention.total_num_heads`, `Qwen3Attention.total_num_kv_heads` | `Qwen3Attention.num_heads`, `Qwen3Attention.num_kv_heads` | 06, 16 | only the per-rank counts are kept |
# | `Qwen3Attention.scaling` | `layers.attention.Attention.scale` | 06 | kept by the attention layer |
# | `Qwen3Attention.qkv_bias` | `Qwen3ForCausalLM.switches`, `Qwen3Attention.qk_norm` | 06 | explicit switches per architecture; upstream turns q/k norm on exactly when there is no q/k/v bias |
# | `Qwen3MLP`, `Qwen3MLP.gate_up_proj`, `Qwen3MLP.down_proj`, `Qwen3MLP.act_fn`, `Qwen3MLP.forward` | = | 06 | same |
# | `Qwen3DecoderLayer`, `Qwen3DecoderLayer.self_attn`, `Qwen3DecoderLayer.mlp`, `Qwen3DecoderLayer.input_layernorm`, `Qwen3DecoderLayer.post_attention_layernorm`, `Qwen3DecoderLayer.forward` | = | 06 | same |
# | `Qwen3Model`, `Qwen3Model.embed_tokens`, `Qwen3Model.layers`, `Qwen3Model.norm`, `Qwen3Model.forward` | = | 06 | same |
# | `Qwen3ForCausalLM`, `Qwen3ForCausalLM.packed_modules_mapping`, `Qwen3ForCausalLM.model`, `Qwen3ForCausalLM.lm_head`, `Qwen3ForCausalLM.forward`, `Qwen3ForCausalLM.compute_logits` | = | 06 | same |
# | — | `Qwen2ForCausalLM`, `models.llama.LlamaForCausalLM`, `models.registry.get_model_class` | 06 | new: Qwen2 and Llama with the same layers, chosen from `architectures` |
# | — | `Qwen3Model.make_layer`, `Qwen3ForCausalLM.model_class` | 06, 26 | new: where a model with other layers (Qwen3-MoE's sparse ones) plugs in |

# %% [markdown] tags=["zh"]
# ### `nanovllm/models/qwen3.py` → `nanovllm/models/qwen3.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `Qwen3Attention`, `Qwen3Attention.num_heads`, `Qwen3Attention.num_kv_heads`, `Qwen3Attention.head_dim`, `Qwen3Attention.q_size`, `Qwen3Attention.kv_size`, `Qwen3Attention.qkv_proj`, `Qwen3Attention.o_proj`, `Qwen3Attention.rotary_emb`, `Qwen3Attention.attn`, `Qwen3Attention.q_norm`, `Qwen3Attention.k_norm`, `Qwen3Attention.forward` | `Qwen3Attention`, `Qwen3Attention.num_heads`, `Qwen3Attention.num_kv_heads`, `Qwen3Attention.head_dim`, `Qwen3Attention.q_size`, `Qwen3Attention.kv_size`, `Qwen3Attention.qkv_proj`, `Qwen3Attention.o_proj`, `Qwen3Attention.rotary_emb`, `Qwen3Attention.attn`, `Qwen3Attention.q_norm`, `Qwen3Attention.k_norm`, `Qwen3Attention.forward`, `Qwen3Attention.norm_and_rotate` | 06 | 相同；各层共用一张旋转位置编码表 |
# | `Qwen3Attention.total_num_heads`, `Qwen3Attention.total_num_kv_heads` | `Qwen3Attention.num_heads`, `Qwen3Attention.num_kv_heads` | 06, 16 | 只保存每个 rank 上的头数 |
# | `Qwen3Attention.scaling` | `layers.attention.Attention.scale` | 06 | 由注意力层保存 |
# | `Qwen3Attention.qkv_bias` | `Qwen3ForCausalLM.switches`, `Qwen3Attention.qk_norm` | 06 | 每种架构显式给出开关；上游恰好在没有 q/k/v 偏置时才打开 q/k 归一化 |
# | `Qwen3MLP`, `Qwen3MLP.gate_up_proj`, `Qwen3MLP.down_proj`, `Qwen3MLP.act_fn`, `Qwen3MLP.forward` | = | 06 | 相同 |
# | `Qwen3DecoderLayer`, `Qwen3DecoderLayer.self_attn`, `Qwen3DecoderLayer.mlp`, `Qwen3DecoderLayer.input_layernorm`, `Qwen3DecoderLayer.post_attention_layernorm`, `Qwen3DecoderLayer.forward` | = | 06 | 相同 |
# | `Qwen3Model`, `Qwen3Model.embed_tokens`, `Qwen3Model.layers`, `Qwen3Model.norm`, `Qwen3Model.forward` | = | 06 | 相同 |
# | `Qwen3ForCausalLM`, `Qwen3ForCausalLM.packed_modules_mapping`, `Qwen3ForCausalLM.model`, `Qwen3ForCausalLM.lm_head`, `Qwen3ForCausalLM.forward`, `Qwen3ForCausalLM.compute_logits` | = | 06 | 相同 |
# | — | `Qwen2ForCausalLM`, `models.llama.LlamaForCausalLM`, `models.registry.get_model_class` | 06 | 新增：用同一套层实现 Qwen2 和 Llama，按 `architectures` 选择 |
# | — | `Qwen3Model.make_layer`, `Qwen3ForCausalLM.model_class` | 06, 26 | 新增：层不同的模型（Qwen3-MoE 的稀疏层）从这里接入 |

# %% [markdown] tags=["en"]
# ### `nanovllm/utils/context.py` → `nanovllm/layers/context.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `Context`, `Context.is_prefill`, `Context.cu_seqlens_q`, `Context.cu_seqlens_k`, `Context.max_seqlen_q`, `Context.max_seqlen_k`, `Context.slot_mapping`, `Context.context_lens`, `Context.block_tables` | = | 07 | the same fields |
# | `_CONTEXT`, `get_context`, `set_context`, `reset_context` | `_STEP`, `get_context`, `set_context`, `reset_context`, `set_prefill_context`, `set_decode_context` | 07 | the same, per thread (a `threading.local`, so that two engines on two threads do not share it), plus two builders from lengths and block tables |

# %% [markdown] tags=["zh"]
# ### `nanovllm/utils/context.py` → `nanovllm/layers/context.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `Context`, `Context.is_prefill`, `Context.cu_seqlens_q`, `Context.cu_seqlens_k`, `Context.max_seqlen_q`, `Context.max_seqlen_k`, `Context.slot_mapping`, `Context.context_lens`, `Context.block_tables` | = | 07 | 字段相同 |
# | `_CONTEXT`, `get_context`, `set_context`, `reset_context` | `_STEP`, `get_context`, `set_context`, `reset_context`, `set_prefill_context`, `set_decode_context` | 07 | 相同，但每个线程一份（`threading.local`，两个线程上的两个引擎不会共用它），另加两个根据长度和块表构造上下文的函数 |

# %% [markdown] tags=["en"]
# ### `nanovllm/engine/model_runner.py` → `nanovllm/engine/model_runner.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `ModelRunner`, `ModelRunner.config`, `ModelRunner.block_size`, `ModelRunner.model`, `ModelRunner.sampler`, `ModelRunner.kv_cache` | = | 09 | one process's runner; a rank wraps it in `engine.tp_runtime.RankWorker` |
# | `ModelRunner.enforce_eager` | `config.Config.enforce_eager`, `engine.cuda_graphs.graphs_unavailable_reason` | 09, 14 | read from the config when graphs are captured |
# | `ModelRunner.world_size`, `ModelRunner.rank` | `engine.tp_runtime.TPRunner.world_size`, `layers.linear.tp_world` | 16 | the driver knows the size; a layer asks `torch.distributed` for its rank |
# | `ModelRunner.event`, `ModelRunner.shm` | `engine.tp_runtime.TPRunner._conns` | 16 | one two-way pipe per rank instead of shared memory and events |
# | `ModelRunner.graph_bs`, `ModelRunner.graphs`, `ModelRunner.graph_pool`, `ModelRunner.graph_vars` | `engine.cuda_graphs.CudaGraphRunner.sizes`, `engine.cuda_graphs.CudaGraphRunner.graphs`, `engine.cuda_graphs.CudaGraphRunner.pool`, `engine.cuda_graphs.CudaGraphRunner.buffers`, `ModelRunner.graphs` | 14 | a runner of their own (`ModelRunner.graphs` holds it); the buffers are a `DecodeBuffers` |
# | `ModelRunner.exit` | = | 09, 16 | releases the KV cache; the TP runner stops its ranks |
# | `ModelRunner.loop`, `ModelRunner.read_shm`, `ModelRunner.write_shm`, `ModelRunner.call` | `engine.tp_runtime.rank_main`, `engine.tp_runtime.TPRunner.call` | 16 | a rank's loop reads calls from its pipe and replies, errors included |
# | `ModelRunner.warmup_model` | `ModelRunner.warmup_model` | 09 | the same warm-up forward |
# | `ModelRunner.allocate_kv_cache` | `ModelRunner.allocate_kv_cache`, `num_kv_blocks`, `kv_block_bytes`, `max_useful_blocks`, `layers.linear.agree_min` | 09, 16 | the same formula on a GPU (an explicit `kvcache_memory_gb` on a CPU), then capped at `max_num_seqs × ceil(max_model_len / block_size)` blocks (`max_useful_blocks`), which upstream does not do; with tensor parallelism every rank takes the smallest count |
# | `ModelRunner.prepare_block_tables` | `layers.context.set_prefill_context`, `layers.context.set_decode_context` | 07 | built with the rest of the attention context |
# | `ModelRunner.prepare_prefill`, `ModelRunner.prepare_decode` | `prepare_prefill`, `prepare_decode` | 09 | functions of the module; a chunk's `seqlen_k` is `num_cached + num_scheduled`, as upstream's is since `25794a1` (2026-04-22; before it, `len(seq)` let a chunk attend to slots not written yet) |
# | `ModelRunner.prepare_sample` | `layers.sampler.sampling_inputs` | 08 | temperatures, top-k, top-p and seeded generators |
# | `ModelRunner.run_model` | `ModelRunner.compute_logits`, `engine.cuda_graphs.CudaGraphRunner.replay` | 09, 14 | eager, or a decode graph's replay |
# | `ModelRunner.run` | `ModelRunner.run`, `ModelRunner.launch`, `SampledTokens` | 09, 18 | samples only rows that want a token; `launch` returns before the GPU is done |
# | `ModelRunner.capture_cudagraph` | `engine.cuda_graphs.capture_decode_graphs`, `engine.cuda_graphs.CudaGraphRunner.capture` | 14 | same order (largest first, one pool) |

# %% [markdown] tags=["zh"]
# ### `nanovllm/engine/model_runner.py` → `nanovllm/engine/model_runner.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `ModelRunner`, `ModelRunner.config`, `ModelRunner.block_size`, `ModelRunner.model`, `ModelRunner.sampler`, `ModelRunner.kv_cache` | = | 09 | 单个进程的执行器；每个 rank 用 `engine.tp_runtime.RankWorker` 包装它 |
# | `ModelRunner.enforce_eager` | `config.Config.enforce_eager`, `engine.cuda_graphs.graphs_unavailable_reason` | 09, 14 | 捕获图时从配置读取 |
# | `ModelRunner.world_size`, `ModelRunner.rank` | `engine.tp_runtime.TPRunner.world_size`, `layers.linear.tp_world` | 16 | 驱动进程知道进程数；各层向 `torch.distributed` 询问自己的 rank |
# | `ModelRunner.event`, `ModelRunner.shm` | `engine.tp_runtime.TPRunner._conns` | 16 | 每个 rank 一条双向管道，取代共享内存和事件 |
# | `ModelRunner.graph_bs`, `ModelRunner.graphs`, `ModelRunner.graph_pool`, `ModelRunner.graph_vars` | `engine.cuda_graphs.CudaGraphRunner.sizes`, `engine.cuda_graphs.CudaGraphRunner.graphs`, `engine.cuda_graphs.CudaGraphRunner.pool`, `engine.cuda_graphs.CudaGraphRunner.buffers`, `ModelRunner.graphs` | 14 | 单独成为一个执行器（由 `ModelRunner.graphs` 持有）；缓冲区是一个 `DecodeBuffers` |
# | `ModelRunner.exit` | = | 09, 16 | 释放 KV 缓存；张量并行的执行器还会停掉各 rank |
# | `ModelRunner.loop`, `ModelRunner.read_shm`, `ModelRunner.write_shm`, `ModelRunner.call` | `engine.tp_runtime.rank_main`, `engine.tp_runtime.TPRunner.call` | 16 | rank 的循环从管道读取调用并回复，出错时也回复 |
# | `ModelRunner.warmup_model` | `ModelRunner.warmup_model` | 09 | 同样的预热前向 |
# | `ModelRunner.allocate_kv_cache` | `ModelRunner.allocate_kv_cache`, `num_kv_blocks`, `kv_block_bytes`, `max_useful_blocks`, `layers.linear.agree_min` | 09, 16 | GPU 上公式相同（CPU 上由 `kvcache_memory_gb` 显式给出），然后封顶为 `max_num_seqs × ceil(max_model_len / block_size)` 个块（`max_useful_blocks`），上游没有这个上限；张量并行时每个 rank 都取最小的块数 |
# | `ModelRunner.prepare_block_tables` | `layers.context.set_prefill_context`, `layers.context.set_decode_context` | 07 | 与注意力上下文的其余部分一起构造 |
# | `ModelRunner.prepare_prefill`, `ModelRunner.prepare_decode` | `prepare_prefill`, `prepare_decode` | 09 | 模块级函数；分块的 `seqlen_k` 是 `num_cached + num_scheduled`，上游自 `25794a1`（2026-04-22）起也是如此（在此之前是 `len(seq)`，分块会关注到尚未写入的槽位） |
# | `ModelRunner.prepare_sample` | `layers.sampler.sampling_inputs` | 08 | 温度、top-k、top-p 和带种子的生成器 |
# | `ModelRunner.run_model` | `ModelRunner.compute_logits`, `engine.cuda_graphs.CudaGraphRunner.replay` | 09, 14 | eager 执行，或重放 decode 图 |
# | `ModelRunner.run` | `ModelRunner.run`, `ModelRunner.launch`, `SampledTokens` | 09, 18 | 只为需要 token 的行采样；`launch` 不等 GPU 算完就返回 |
# | `ModelRunner.capture_cudagraph` | `engine.cuda_graphs.capture_decode_graphs`, `engine.cuda_graphs.CudaGraphRunner.capture` | 14 | 顺序相同（从最大的开始，共用一个显存池） |

# %% [markdown] tags=["en"]
# ### `nanovllm/utils/loader.py` → `nanovllm/models/loader.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `default_weight_loader` | `load_model`, `layers.linear.copy_checked` | 06 | a parameter without a loader is copied after a shape check |
# | `load_model` | `load_model`, `build_model` | 06 | refuses missing, unexpected and twice-loaded tensors by name |
# | — | `read_model_dir`, `check_model_config` | 06 | new: the one reader of `config.json` (`Config` calls it); a size no model can have is refused by field and file |

# %% [markdown] tags=["zh"]
# ### `nanovllm/utils/loader.py` → `nanovllm/models/loader.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `default_weight_loader` | `load_model`, `layers.linear.copy_checked` | 06 | 没有加载器的参数在检查形状后直接拷贝 |
# | `load_model` | `load_model`, `build_model` | 06 | 按名字拒绝缺失的、多余的和重复加载的张量 |
# | — | `read_model_dir`, `check_model_config` | 06 | 新增：`config.json` 唯一的读取者（由 `Config` 调用）；任何模型都不可能有的尺寸会被拒绝，并指明字段和文件 |

# %% [markdown] tags=["en"]
# ### `nanovllm/config.py` → `nanovllm/config.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `Config`, `Config.model`, `Config.max_num_batched_tokens`, `Config.max_num_seqs`, `Config.max_model_len`, `Config.gpu_memory_utilization`, `Config.tensor_parallel_size`, `Config.enforce_eager`, `Config.kvcache_block_size`, `Config.num_kvcache_blocks`, `Config.hf_config` | = | 09 | the same names and defaults |
# | `Config.eos` | `Config.eos_token_ids`, `declared_eos_ids` | 09 | every end-of-sequence id of `generation_config.json` or `config.json` |
# | `Config.__post_init__` | `Config.__post_init__`, `Config.from_kwargs`, `models.loader.read_model_dir`, `utils.checks.check` | 09 | every field checked; a block size is any power of two up to 1024 (upstream: multiples of 256) |
# | — | `Config.device`, `Config.dtype`, `Config.attention_backend`, `Config.enable_prefix_caching`, `Config.kvcache_memory_gb`, `Config.compile_small_ops`, `Config.async_scheduling`, `Config.fork_samples` | 09 | new settings, for the CPU and for the features of chapters 03, 05, 11, 14 and 18 |

# %% [markdown] tags=["zh"]
# ### `nanovllm/config.py` → `nanovllm/config.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `Config`, `Config.model`, `Config.max_num_batched_tokens`, `Config.max_num_seqs`, `Config.max_model_len`, `Config.gpu_memory_utilization`, `Config.tensor_parallel_size`, `Config.enforce_eager`, `Config.kvcache_block_size`, `Config.num_kvcache_blocks`, `Config.hf_config` | = | 09 | 名字和默认值相同 |
# | `Config.eos` | `Config.eos_token_ids`, `declared_eos_ids` | 09 | `generation_config.json` 或 `config.json` 里的每一个结束符 id |
# | `Config.__post_init__` | `Config.__post_init__`, `Config.from_kwargs`, `models.loader.read_model_dir`, `utils.checks.check` | 09 | 检查每个字段；块大小可以是不超过 1024 的任意 2 的幂（上游要求是 256 的倍数） |
# | — | `Config.device`, `Config.dtype`, `Config.attention_backend`, `Config.enable_prefix_caching`, `Config.kvcache_memory_gb`, `Config.compile_small_ops`, `Config.async_scheduling`, `Config.fork_samples` | 09 | 新增的配置项，用于 CPU，以及第 03、05、11、14、18 章的功能 |

# %% [markdown] tags=["en"]
# ### `nanovllm/engine/llm_engine.py` → `nanovllm/engine/llm_engine.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `LLMEngine`, `LLMEngine.model_runner`, `LLMEngine.tokenizer`, `LLMEngine.scheduler`, `LLMEngine.is_finished`, `LLMEngine.exit` | = | 10, 17, 20 | same |
# | `LLMEngine.ps`, `LLMEngine.events` | `engine.tp_runtime.TPRunner._procs`, `engine.tp_runtime.TPRunner._conns` | 16 | the rank processes and their pipes belong to the TP runner |
# | `LLMEngine.add_request` | `LLMEngine.add_request`, `LLMEngine.make_sequence` | 10, 20 | checks the request first (vocabulary, `max_model_len`, the cache) and returns its id |
# | `LLMEngine.step` | = | 10, 18, 20 | returns `(finished, num_tokens, is_prefill)`; upstream counts decode tokens as negative |
# | `LLMEngine.generate` | = | 10, 20 | checks every request before queueing any |

# %% [markdown] tags=["zh"]
# ### `nanovllm/engine/llm_engine.py` → `nanovllm/engine/llm_engine.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `LLMEngine`, `LLMEngine.model_runner`, `LLMEngine.tokenizer`, `LLMEngine.scheduler`, `LLMEngine.is_finished`, `LLMEngine.exit` | = | 10, 17, 20 | 相同 |
# | `LLMEngine.ps`, `LLMEngine.events` | `engine.tp_runtime.TPRunner._procs`, `engine.tp_runtime.TPRunner._conns` | 16 | rank 进程及其管道归张量并行执行器所有 |
# | `LLMEngine.add_request` | `LLMEngine.add_request`, `LLMEngine.make_sequence` | 10, 20 | 先检查请求（词表、`max_model_len`、缓存），再返回它的编号 |
# | `LLMEngine.step` | = | 10, 18, 20 | 返回 `(finished, num_tokens, is_prefill)`；上游用负数表示 decode 的 token 数 |
# | `LLMEngine.generate` | = | 10, 20 | 在排入任何请求之前先检查所有请求 |

# %% [markdown] tags=["en"]
# ### `nanovllm/llm.py` → `nanovllm/llm.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `LLM` | = | 10 | same |

# %% [markdown] tags=["zh"]
# ### `nanovllm/llm.py` → `nanovllm/llm.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `LLM` | = | 10 | 相同 |

# %% [markdown] tags=["en"]
# ### `nanovllm/__init__.py` → `nanovllm/__init__.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `LLM`, `SamplingParams` | = | 00 | the same public API |

# %% [markdown] tags=["zh"]
# ### `nanovllm/__init__.py` → `nanovllm/__init__.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `LLM`, `SamplingParams` | = | 00 | 相同的公开 API |

# %% [markdown] tags=["en"]
# ### `bench.py` → `nanovllm/bench/engine.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `main` | `main`, `make_workload` | 19 | `python -m nanovllm.bench`: the same workload, and a `transformers` peer |

# %% [markdown] tags=["zh"]
# ### `bench.py` → `nanovllm/bench/engine.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `main` | `main`, `make_workload` | 19 | `python -m nanovllm.bench`：同样的负载，外加一个 `transformers` 对照组 |

# %% [markdown] tags=["en"]
# ### `example.py` → `nanovllm/__main__.py`
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `main` | = | 10 | `python -m nanovllm`: the command line; chapter 00 generates text |

# %% [markdown] tags=["zh"]
# ### `example.py` → `nanovllm/__main__.py`
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `main` | = | 10 | `python -m nanovllm`：命令行；第 00 章生成文本 |

# %% [markdown] tags=["en"]
# ### Files without code
#
# | upstream | this book | ch. | note |
# |---|---|---|---|
# | `README.md` | `./README.md` | — | both languages, the two commands |
# | `pyproject.toml` | `./pyproject.toml` | — | pinned versions, the dev tools |
# | `LICENSE` | — | — | this repository has none yet |
# | `.gitignore` | `./.gitignore` | — | same role |
# | `assets/logo.png` | — | — | — |

# %% [markdown] tags=["zh"]
# ### 不含代码的文件
#
# | 上游 | 本书 | 章 | 说明 |
# |---|---|---|---|
# | `README.md` | `./README.md` | — | 中英双语，两个命令 |
# | `pyproject.toml` | `./pyproject.toml` | — | 固定的版本，开发工具 |
# | `LICENSE` | — | — | 本仓库尚未附带 |
# | `.gitignore` | `./.gitignore` | — | 作用相同 |
# | `assets/logo.png` | — | — | — |

# %% [markdown] tags=["en"]
# ## Behaviour: where the two engines differ
#
# Each row names the code of ours where the difference lives, and the chapter that shows it
# (most of them with an executed, asserted cell).

# %% [markdown] tags=["zh"]
# ## 行为：两个引擎哪里不同
#
# 每一行都给出差异所在的代码，以及展示它的章节（其中大多数配有执行过、带断言的代码单元）。

# %% [markdown] tags=["en"]
# | difference | this book | ch. | upstream | this book, and why |
# |---|---|---|---|---|
# | which sequence may be a chunk | `engine.scheduler.Scheduler._schedule_prefill` | 04 | only the first of a step | whichever runs out the budget: full steps, first tokens sooner; at most one half-prefilled sequence at a time |
# | decode batch size | `engine.scheduler.Scheduler._schedule_decode` | 04 | up to `max_num_seqs` | up to `min(max_num_seqs, max_num_batched_tokens)`: each sequence computes one token, and the budget bounds every step (the warm-up that sized the KV cache measured no larger step) |
# | status changes | `engine.sequence.Sequence.status`, `engine.sequence.Sequence.ALLOWED_TRANSITIONS` | 01 | any assignment | only along the state diagram's arrows: a scheduler bug fails loudly instead of corrupting the cache |
# | a request that can never fit | `engine.sequence.Sequence.max_kv_tokens`, `engine.scheduler.Scheduler.check_fits`, `engine.llm_engine.LLMEngine.make_sequence` | 04, 10 | accepted; then `assert scheduled_seqs` fails or it preempts itself forever | refused when added, with a message; so is a prompt plus `max_tokens` beyond `max_model_len` |
# | stale prefix-cache entries | `engine.prefix_cache.PrefixCache.forget` | 03 | kept until 2026-04-26 (silently wrong KV); since `f64d821` removed when the block is reused | removed when the block is reused, only if the entry still points at it; a provenance fuzz guards it |
# | `block_size` in a worker process | `engine.sequence.Sequence.__getstate__`, `engine.tp_runtime.RankWorker` | 01, 16 | a class attribute set in the driver only: with `kvcache_block_size=512`, rank processes place decode tokens by the default 256 | travels with each pickled sequence, and the rank checks it against its own |
# | sampling | `layers.sampler.Sampler`, `layers.triton_sampler.triton_temperature_sample` | 08, 12 | temperature only; greedy refused | greedy at temperature 0, top-k, top-p, per-request seeds tied to the token position; Triton kernels on a GPU |
# | attention kernels | `layers.attention.TorchBackend`, `layers.triton_attention.TritonBackend`, `layers.triton_attention.FlashAttnBackend` | 07, 11 | flash-attn (`flash_attn_varlen_func`, `flash_attn_with_kvcache`) and a Triton store kernel | our own Triton kernels (varlen prefill over cached prefixes, split-K decode), a plain-torch reference that runs on a CPU; FlashAttention 4 (not 2) as an option, verified on the H200 |
# | asynchronous scheduling | `engine.scheduler.Scheduler.advance`, `engine.scheduler.Scheduler.resolve`, `engine.model_runner.ModelRunner.launch`, `engine.llm_engine.LLMEngine.step` | 18 | none: each step waits for its tokens | on CUDA, step n + 1 is queued before step n's tokens are collected |
# | tensor-parallel processes | `engine.tp_runtime.TPRunner`, `engine.tp_runtime.rank_main`, `layers.linear.agree_min` | 16 | rank 0 in your process; shared memory (1 MiB, fixed name) and events; a fixed port; each rank sizes its own KV pool | every rank a process, yours only drives; a two-way pipe per rank reports errors; a free port; all ranks take the smallest block count; gloo on a CPU |
# | CUDA-graph batch sizes | `engine.cuda_graphs.capture_sizes`, `engine.cuda_graphs.graph_batch_size` | 14 | 1, 2, 4, 8, then multiples of 16 up to `min(max_num_seqs, 512)`: with `max_num_seqs=100` a batch of 97 to 100 finds no graph and `next(...)` raises | the same, plus `min(max_num_seqs, 512)` itself |
# | end of sequence | `config.declared_eos_ids`, `engine.scheduler.Scheduler.eos_token_ids` | 04, 09 | the tokenizer's one `eos_token_id` | every id the model declares (chat models often declare two) |
# | unknown settings | `config.Config.from_kwargs`, `config.UnknownConfigKeyError` | 09 | silently dropped | refused, with the closest valid name |
# | bad input | `sampling_params.SamplingParams`, `engine.sequence.Sequence`, `config.Config` | 01, 09 | `assert`, or a failure deep inside a step | `TypeError` or `ValueError` at once, naming the field |
# | a step that raises | `engine.scheduler.Scheduler.rollback`, `engine.scheduler.Scheduler.abort` | 20 | nothing undoes the step's schedule | the schedule is undone and the same step can run again |
# | models and devices | `models.registry.get_model_class`, `config.Config.device` | 06, 09, 16 | Qwen3 on CUDA | Qwen3, Qwen2 and Llama; CPU or CUDA |
# | mixture of experts | `models.qwen3_moe.SparseMoeBlock`, `models.qwen3_moe.Qwen3MoeForCausalLM` | 26 | none (new models are out of upstream's scope) | Qwen3-MoE, token-exact with `transformers`: a router's top-k with renormalized weights, experts split across tensor-parallel ranks with one all-reduce |
# | several samples of one prompt | `sampling_params.SamplingParams.n`, `engine.scheduler.Scheduler._fork_siblings`, `engine.block_manager.BlockManager.fork`, `engine.model_runner.copy_kv_blocks` | 05, 09 | not supported: n requests with the same prompt | `n` samples share one prefill and their blocks; a sample that writes a shared block first gets its own copy (copy-on-write) |
# | logits that are not numbers | `layers.sampler.NON_FINITE`, `engine.llm_engine.NonFiniteLogitsError` | 08, 20 | NaN weights silently generate token 0 | the sampler marks the row on the device (no extra wait for the GPU); the request is dropped with an error naming the likely cause (the tensor holding NaN), and the others go on |
# | several threads on one engine | `engine.llm_engine.LLMEngine._one_call`, `engine.llm_engine.EngineBusyError` | 20 | no guard: interleaved steps corrupt the queues | one call at a time, under a lock; a call from inside another call (an observer) raises instead of waiting for itself |
# | two engines in one process | `layers.context.get_context`, `models.loader.DefaultFloatDtype` | 06, 07 | one attention context for the process, and `torch.set_default_dtype` while a model is built: two engines on two threads compute wrong tokens, and build in each other's dtype | the context is per thread; a model is built in its dtype by a torch function mode of the building thread, and the process default is never touched |
# | Ctrl-C in the middle of a step | `utils.interrupts.deferred_interrupt`, `utils.interrupts.interruptible`, `engine.llm_engine.LLMEngine._one_call` | 16, 20 | wherever it lands: a half-scheduled step, blocks leaked, requests lost | held back until the engine's books are whole; let through at once only while the model computes a step (which `rollback` undoes) and between `generate`'s steps |
# | an observer that raises | `engine.scheduler.Scheduler._notify`, `engine.scheduler.Scheduler.observer_errors` | 04, 20 | no observer | the engine keeps the error until the step is whole, then the call raises it; nothing else fails |
# | what `step` reports | `engine.llm_engine.StepOutput` | 20 | `(seq_id, token_ids)` pairs | the same pairs, which also name the request and the sample index (the samples of `n > 1` finish under seq_ids of their own) |
# | a chunk that ends inside its prompt | `engine.model_runner.ModelRunner.sample`, `engine.model_runner.NOT_SAMPLED`, `engine.scheduler.Scheduler.postprocess` | 04, 09 | its row is sampled like every other, and postprocess throws the token away | its row is not sampled (the runner returns `-1` for it): the token could only be thrown away, since the row's logits predict a position inside the prompt |
# | how many KV blocks | `engine.model_runner.num_kv_blocks`, `engine.model_runner.max_useful_blocks` | 09 | all the memory that `gpu_memory_utilization` leaves | the same on a GPU, but at most `max_num_seqs × ceil(max_model_len / block_size)`: more blocks could never be held at once (they would only keep more freed prefixes cached), and a small model on a laptop would reserve memory it never fills |
# | the KV cache's dtype | `config.Config.kv_cache_dtype`, `layers.kv_quant.quantize_kv`, `engine.model_runner.kv_block_bytes` | 24 | the model's dtype | the model's dtype, or with `kv_cache_dtype="fp8"` float8 e4m3 with one float32 scale per token and KV head: about twice the blocks in the same memory and half the KV bytes for decode to read, at a perplexity within 2 % on SmolLM2 |
# | RMSNorm after a residual | `layers.layernorm.rms_norm` | 06 | adds the residual in float32 and normalizes that float32 sum; returns the sum rounded to the model's dtype | adds in the model's dtype and normalizes the rounded sum, as `transformers` does, so the book's models match `transformers`, which the tests compare against; in bf16 the residual stream is the same and the normalized output can differ in its last bits (checked below) |

# %% [markdown] tags=["zh"]
# | 差异 | 本书 | 章 | 上游 | 本书的做法及原因 |
# |---|---|---|---|---|
# | 哪个序列可以被分块 | `engine.scheduler.Scheduler._schedule_prefill` | 04 | 只有一步中的第一个序列 | 哪个序列用完预算就分块哪个：每步都用满预算，第一个 token 来得更早；同一时刻最多一个 prefill 到一半的序列 |
# | decode 批大小 | `engine.scheduler.Scheduler._schedule_decode` | 04 | 最多 `max_num_seqs` 个 | 最多 `min(max_num_seqs, max_num_batched_tokens)` 个：每个序列计算一个 token，而预算约束每一步（确定 KV 缓存大小的预热没有测量过更大的步） |
# | 状态变化 | `engine.sequence.Sequence.status`, `engine.sequence.Sequence.ALLOWED_TRANSITIONS` | 01 | 任意赋值 | 只能沿状态图的箭头变化：调度器出错时会立刻报错，而不是悄悄弄坏缓存 |
# | 永远放不下的请求 | `engine.sequence.Sequence.max_kv_tokens`, `engine.scheduler.Scheduler.check_fits`, `engine.llm_engine.LLMEngine.make_sequence` | 04, 10 | 照单全收；随后 `assert scheduled_seqs` 失败，或者它无休止地抢占自己 | 加入时即被拒绝，并给出说明；提示词加 `max_tokens` 超过 `max_model_len` 的请求同样被拒绝 |
# | 前缀缓存的过期条目 | `engine.prefix_cache.PrefixCache.forget` | 03 | 2026-04-26 之前一直保留（悄悄复用错误的 KV）；自 `f64d821` 起，块被重新使用时删除 | 块被重新使用时删除，且只在条目仍指向它时才删；有溯源模糊测试把关 |
# | 工作进程中的 `block_size` | `engine.sequence.Sequence.__getstate__`, `engine.tp_runtime.RankWorker` | 01, 16 | 只在驱动进程里设置的类属性：`kvcache_block_size=512` 时，rank 进程仍按默认值 256 计算 decode token 的槽位 | 随每个序列化的序列一起传送，rank 还会与自己的配置核对 |
# | 采样 | `layers.sampler.Sampler`, `layers.triton_sampler.triton_temperature_sample` | 08, 12 | 只有温度；不接受贪心解码 | 温度为 0 时贪心、top-k、top-p、与 token 位置绑定的逐请求随机种子；GPU 上用 Triton 内核 |
# | 注意力内核 | `layers.attention.TorchBackend`, `layers.triton_attention.TritonBackend`, `layers.triton_attention.FlashAttnBackend` | 07, 11 | flash-attn（`flash_attn_varlen_func`、`flash_attn_with_kvcache`）和一个 Triton 写入内核 | 我们自己的 Triton 内核（读取已缓存前缀的变长 prefill、split-K decode），以及能在 CPU 上运行的纯 torch 参考实现；FlashAttention 4（不是第 2 版）作为可选项，已在 H200 上验证 |
# | 异步调度 | `engine.scheduler.Scheduler.advance`, `engine.scheduler.Scheduler.resolve`, `engine.model_runner.ModelRunner.launch`, `engine.llm_engine.LLMEngine.step` | 18 | 没有：每一步都等自己的 token | 在 CUDA 上，先把第 n + 1 步排进队列，再收取第 n 步的 token |
# | 张量并行的进程 | `engine.tp_runtime.TPRunner`, `engine.tp_runtime.rank_main`, `layers.linear.agree_min` | 16 | rank 0 在你的进程里；共享内存（1 MiB，固定名字）加事件；固定端口；每个 rank 各自确定 KV 块池大小 | 每个 rank 都是独立进程，你的进程只负责驱动；每个 rank 一条双向管道，出错会报告；空闲端口；所有 rank 取最小的块数；CPU 上用 gloo |
# | CUDA Graph 的批大小 | `engine.cuda_graphs.capture_sizes`, `engine.cuda_graphs.graph_batch_size` | 14 | 1、2、4、8，然后是 16 的倍数，直到 `min(max_num_seqs, 512)`：`max_num_seqs=100` 时，97 到 100 的批次找不到图，`next(...)` 抛出异常 | 相同，另加 `min(max_num_seqs, 512)` 本身 |
# | 结束符 | `config.declared_eos_ids`, `engine.scheduler.Scheduler.eos_token_ids` | 04, 09 | 分词器的唯一一个 `eos_token_id` | 模型声明的每一个 id（聊天模型常常声明两个） |
# | 未知的配置项 | `config.Config.from_kwargs`, `config.UnknownConfigKeyError` | 09 | 悄悄丢掉 | 拒绝，并提示最接近的合法名字 |
# | 错误的输入 | `sampling_params.SamplingParams`, `engine.sequence.Sequence`, `config.Config` | 01, 09 | `assert`，或者在某一步深处出错 | 立即抛出 `TypeError` 或 `ValueError`，并指明字段 |
# | 出错的一步 | `engine.scheduler.Scheduler.rollback`, `engine.scheduler.Scheduler.abort` | 20 | 没有任何机制撤销这一步的调度 | 撤销这一步的调度，同一步可以再跑一次 |
# | 模型与设备 | `models.registry.get_model_class`, `config.Config.device` | 06, 09, 16 | CUDA 上的 Qwen3 | Qwen3、Qwen2 和 Llama；CPU 或 CUDA |
# | 混合专家 | `models.qwen3_moe.SparseMoeBlock`, `models.qwen3_moe.Qwen3MoeForCausalLM` | 26 | 没有（新模型不在上游的范围内） | Qwen3-MoE，与 `transformers` 逐 token 一致：路由器的 top-k 与重新归一化的权重，专家切分到张量并行的各 rank 上、只做一次 all-reduce |
# | 一个提示词的多个样本 | `sampling_params.SamplingParams.n`, `engine.scheduler.Scheduler._fork_siblings`, `engine.block_manager.BlockManager.fork`, `engine.model_runner.copy_kv_blocks` | 05, 09 | 不支持：只能提交 n 个相同提示词的请求 | `n` 个样本共用一次 prefill 和它的块；要写入共享块的样本先得到自己的副本（写时复制） |
# | 不是数的 logits | `layers.sampler.NON_FINITE`, `engine.llm_engine.NonFiniteLogitsError` | 08, 20 | 权重含 NaN 时悄悄地一直生成 token 0 | 采样器在设备上标记那一行（不必多等 GPU）；丢弃该请求，报错指出可能的原因（含 NaN 的张量），其他请求照常进行 |
# | 多个线程共用一个引擎 | `engine.llm_engine.LLMEngine._one_call`, `engine.llm_engine.EngineBusyError` | 20 | 没有保护：交错执行的步骤会弄乱队列 | 加锁，一次只处理一个调用；在另一个调用内部发起的调用（比如观察者）抛出异常，而不是等待它自己 |
# | 同一进程中的两个引擎 | `layers.context.get_context`, `models.loader.DefaultFloatDtype` | 06, 07 | 整个进程只有一个注意力上下文，构建模型时调用 `torch.set_default_dtype`：两个线程上的两个引擎会算出错误的 token，还会用对方的数据类型构建模型 | 上下文每个线程一份；模型由构建它的线程上的一个 torch 函数模式按它自己的数据类型构建，进程的默认值从不改动 |
# | 一步进行到一半时按下 Ctrl-C | `utils.interrupts.deferred_interrupt`, `utils.interrupts.interruptible`, `engine.llm_engine.LLMEngine._one_call` | 16, 20 | 落在哪里就在哪里生效：调度到一半的步、泄漏的块、丢失的请求 | 压到引擎的账目完整时才生效；只有模型计算一步时（由 `rollback` 撤销）和 `generate` 的两步之间才立刻放行 |
# | 抛出异常的观察者 | `engine.scheduler.Scheduler._notify`, `engine.scheduler.Scheduler.observer_errors` | 04, 20 | 没有观察者 | 引擎先把异常存起来，等这一步完整后由调用抛出；其他一切照常 |
# | `step` 报告的内容 | `engine.llm_engine.StepOutput` | 20 | `(seq_id, token_ids)` 二元组 | 同样的二元组，另外指明所属请求和样本序号（`n > 1` 的样本以各自的 seq_id 结束） |
# | 停在提示词内部的分块 | `engine.model_runner.ModelRunner.sample`, `engine.model_runner.NOT_SAMPLED`, `engine.scheduler.Scheduler.postprocess` | 04, 09 | 它那一行和其他行一样被采样，再由后处理把 token 扔掉 | 不对它那一行采样（执行器为它返回 `-1`）：这一行的 logits 预测的是提示词内部的位置，采出的 token 只能被扔掉 |
# | KV 块的数量 | `engine.model_runner.num_kv_blocks`, `engine.model_runner.max_useful_blocks` | 09 | `gpu_memory_utilization` 剩下的全部显存 | GPU 上相同，但最多 `max_num_seqs × ceil(max_model_len / block_size)` 个：更多的块永远不可能同时被持有（它们只能多留一些已释放的前缀在缓存里），而笔记本电脑上的小模型会预留一大块永远填不满的内存 |
# | KV 缓存的数据类型 | `config.Config.kv_cache_dtype`, `layers.kv_quant.quantize_kv`, `engine.model_runner.kv_block_bytes` | 24 | 模型的数据类型 | 模型的数据类型；或者设 `kv_cache_dtype="fp8"`，用 float8 e4m3 存储，每个 token、每个 KV 头带一个 float32 缩放因子：同样的显存放下约两倍的块，decode 要读的 KV 字节减半，SmolLM2 上的困惑度变化在 2 % 以内 |
# | 加上残差之后的 RMSNorm | `layers.layernorm.rms_norm` | 06 | 在 float32 下加上残差，并对这个 float32 的和做归一化；返回的和舍入到模型的数据类型 | 按模型的数据类型相加，并对舍入后的和做归一化，与 `transformers` 一致，因此本书的模型与测试所对照的 `transformers` 相符；bf16 下残差流相同，归一化的输出在最后几位上可能不同（见下文的检查） |

# %% [markdown] tags=["en"]
# ## The code the second article quotes: upstream before chunked prefill
#
# The second article this book answers walks through nano-vllm's scheduler and block manager
# with the vLLM paper's figures. Its `block_manager.py` and `scheduler.py` are those of
# upstream's `main` from `df99418` (2025-08-31, which dropped `BlockManager`'s
# `assert num_blocks > 0`) until the merges of 2026-04-13. Two lines date it: its
# `_allocate_block` still ends in `return self.blocks[block_id]`, which `9e8507e` shortened to
# `return block` that evening, and its `deallocate` does not reset `seq.prefilled`, a line from
# `82f5ca2` that the first of those merges (`7f967ed`) brought in. Chunked prefill arrived the
# next day (`8d63a98`, 2026-04-14). The tables above map `bb823b3`, by which time five things in
# those two files had changed. Each row says what the article shows, what upstream did since
# (with the commit that did it), and what this book does and why; the cell after the table
# checks the book's side of every row. The fourth row is why chapter 03 calls the article's
# `_allocate_block` the version with the stale-entry bug.
#
# | what | this book | ch. | the article's upstream (`df99418` to 2026-04-13) | upstream since | this book, and why |
# |---|---|---|---|---|---|
# | when a block is hashed | `engine.prefix_cache.PrefixCache.publish`, `engine.block_manager.BlockManager.publish_full_blocks` | 03 | in `allocate`, every full block of the prompt; in `may_append`, the last block once the token about to be computed fills it: both before the step writes the KV | `hash_blocks`, called by postprocess after the step (`f64d821`) | after the step that wrote the KV (rule 1). Hashing first was safe without chunks: the step that writes a block runs before any later lookup, and a hit in that same prefill step reads KV that the forward stores first, layer by layer. A chunked prefill leaves a block unwritten for whole steps, during which another request could hit it |
# | `can_allocate` | `engine.block_manager.BlockManager.can_allocate` | 02, 03 | `len(free_block_ids) >= seq.num_blocks`: cache hits are not counted; and the budget test adds the whole prompt (`num_batched_tokens + len(seq)`) | the budget counts only the uncached tokens, counted after the cache lookup (`77dd709`, 2026-04-20); hits on blocks in use need no free block (`f64d821`) | as upstream does now: only the blocks that must come from the free list count, and only the tokens that will be computed. The old test was safe but too strict: a prompt that shares most of its blocks could wait for memory it does not need |
# | a fully cached prompt | `engine.prefix_cache.PrefixCache.match` | 03 | every full block may hit, the last one too: a prompt whose blocks are all cached has nothing left to compute, and the LM head takes its logits from another sequence's row (or finds no row when the sequence is alone in the step) | the last token is recomputed (`8d63a98`); then the last block is never looked up (`f64d821`) | the block that holds the prompt's last token is never a hit (rule 3): that token is computed, and its logits give the first new token |
# | stale entries | `engine.prefix_cache.PrefixCache.forget` | 03 | `_allocate_block` resets a reused block and leaves its old entry in `hash_to_block_id`: a later prompt can hit KV written for another prefix | the entry is deleted when it still points at the block (`f64d821`) | the same rule, in `forget`; chapter 03 builds the false hit, and a fuzz test guards against it |
# | chunked prefill | `engine.scheduler.Scheduler._schedule_prefill` | 04 | none: a prompt is prefilled whole or waits, and `Config` requires `max_num_batched_tokens >= max_model_len` so that every prompt fits one step | chunks, of the first sequence of a step only (`8d63a98`) | chunks whichever sequence runs out the budget (chapter 04 compares the two rules), so the budget may be smaller than `max_model_len` |

# %% [markdown] tags=["zh"]
# ## 第二篇文章引用的代码：分块 prefill 之前的上游
#
# 本书所回应的第二篇文章借用 vLLM 论文的插图讲解 nano-vllm 的调度器和块管理器。它的 `block_manager.py` 和
# `scheduler.py` 是上游 `main` 分支从 `df99418`（2025-08-31，去掉了 `BlockManager` 的 `assert num_blocks > 0`）
# 到 2026-04-13 那几次合并之前的版本。有两行代码可以确定它的年代：它的 `_allocate_block` 仍以
# `return self.blocks[block_id]` 结尾，当晚 `9e8507e` 才把它简化成 `return block`；它的 `deallocate` 没有重置
# `seq.prefilled`，这一行来自 `82f5ca2`，由那几次合并中的第一次（`7f967ed`）并入。分块 prefill 在第二天
# （`8d63a98`，2026-04-14）到来。上面的表格对照的是 `bb823b3`，那时这两个文件已有五处改变。每一行给出文章里的
# 写法、上游后来的做法（附上做出改动的提交），以及本书的做法和原因；表格后面的单元逐行检查本书这一侧。第四行就是
# 第 03 章把文章中的 `_allocate_block` 称为带着过期条目缺陷的版本的原因。
#
# | 内容 | 本书 | 章 | 文章所引用的上游（`df99418` 至 2026-04-13） | 上游后来的做法 | 本书的做法及原因 |
# |---|---|---|---|---|---|
# | 什么时候求块的哈希 | `engine.prefix_cache.PrefixCache.publish`, `engine.block_manager.BlockManager.publish_full_blocks` | 03 | 在 `allocate` 里为提示词的每个写满的块求哈希；在 `may_append` 里，当即将计算的 token 填满最后一块时为它求哈希：两者都在这一步写入 KV 之前 | 由后处理在这一步之后调用的 `hash_blocks`（`f64d821`） | 在写入 KV 的那一步之后（规则 1）。没有分块时先求哈希是安全的：写入某个块的那一步总在之后的任何查找之前运行，而同一个 prefill 步里的命中读到的 KV，已由前向计算逐层先行写入。分块 prefill 会让一个块在好几步里都没有写完，这期间别的请求可能命中它 |
# | `can_allocate` | `engine.block_manager.BlockManager.can_allocate` | 02, 03 | `len(free_block_ids) >= seq.num_blocks`：不计缓存命中；预算检查也加上整个提示词（`num_batched_tokens + len(seq)`） | 预算只计未缓存的 token，并且在查找缓存之后才计算（`77dd709`，2026-04-20）；命中正在使用的块不需要空闲块（`f64d821`） | 与上游现在的做法相同：只计必须从空闲队列取的块，只计将要计算的 token。旧的检查是安全的，只是太严：一个大部分块都能共享的提示词，可能要等它根本用不着的显存 |
# | 全部命中缓存的提示词 | `engine.prefix_cache.PrefixCache.match` | 03 | 每个写满的块都可以命中，最后一块也不例外：所有块都已缓存的提示词没有任何东西要算，LM head 从另一个序列的那一行取 logits（序列单独成一步时则根本没有这一行） | 重新计算最后一个 token（`8d63a98`）；后来干脆不查找最后一块（`f64d821`） | 包含提示词最后一个 token 的块永远不会命中（规则 3）：这个 token 要计算，它的 logits 给出第一个新 token |
# | 过期条目 | `engine.prefix_cache.PrefixCache.forget` | 03 | `_allocate_block` 重置被重新使用的块，却把它的旧条目留在 `hash_to_block_id` 里：之后的提示词可能命中为另一段前缀写入的 KV | 条目仍指向这个块时将其删除（`f64d821`） | 同样的规则，写在 `forget` 里；第 03 章构造出这次错误命中，模糊测试防止它再次出现 |
# | 分块 prefill | `engine.scheduler.Scheduler._schedule_prefill` | 04 | 没有：提示词要么整个 prefill，要么等待；`Config` 要求 `max_num_batched_tokens >= max_model_len`，保证每个提示词都能在一步里放下 | 分块，但只限一步中的第一个序列（`8d63a98`） | 哪个序列用完预算就把哪个分块（第 04 章比较了两种规则），所以预算可以小于 `max_model_len` |

# %% printed phrases
#| hide
# en: What this chapter prints, in Chinese for the Chinese site (appendix D, nanovllm.book.lang).
# zh: 本章打印的文字及其中文（见附录 D 与 nanovllm.book.lang），中文网站打印中文。
from nanovllm.book.lang import Phrases

say = Phrases({
    "the book's side of the second article's five rows holds": "第二篇文章那五行里，本书这一侧的说法都成立",
    "{upstream} upstream names, {ours} names of ours, {rows} rows per language":
        "上游的名字 {upstream} 个，本书的名字 {ours} 个，每种语言 {rows} 行",
    "upstream files: {files}, problems: {problems}": "上游文件：{files} 个，问题：{problems} 个",
    "three chained block hashes equal upstream's; the last is {last:#018x}": "三个链式块哈希与上游的相同；最后一个是 {last:#018x}",
    "max_num_seqs=100: upstream has no graph for batches {first}-{last}; ours replays {ours} for them":
        "max_num_seqs=100：上游没有批大小 {first}-{last} 的图；本书为它们重放大小 {ours} 的图",
    "RMSNorm in bf16: the same residual: {same}; outputs differ in {share:.0%} of the elements, by at most {ulps} units "
    "in the last place": "bf16 的 RMSNorm：残差相同：{same}；{share:.0%} 的元素输出不同，最多相差最后一位的 {ulps} 个单位",
})

# %% the second article's rows
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams


def computed(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """A step wrote the KV of ``num_tokens`` more tokens of ``seq``; postprocess publishes what is full."""
    # zh: 一步写入了 ``seq`` 又 ``num_tokens`` 个 token 的 KV；后处理发布写满的块。
    seq.num_cached_tokens += num_tokens
    bm.publish_full_blocks(seq)


# en: When a block is hashed: allocation publishes nothing, and a 6-token chunk publishes only the block it filled.
# zh: 什么时候求哈希：分配时什么也不发布；一个 6 个 token 的分块只发布它写满的那一块。
pool = BlockManager(num_blocks=8, block_size=4)
chunked = Sequence(list(range(12)), block_size=4)
pool.allocate(chunked)
published_at_allocation = dict(pool.hash_to_block_id)
computed(pool, chunked, 6)
assert published_at_allocation == {} and list(pool.hash_to_block_id.values()) == chunked.block_table[:1]

# en: can_allocate: 3 blocks needed, 2 of them held by a running sequence, 1 free: admitted (upstream then: 1 < 3).
# zh: can_allocate：需要 3 个块，其中 2 个被一个运行中的序列持有，空闲 1 个：接纳（当时的上游：1 < 3，拒绝）。
pool = BlockManager(num_blocks=4, block_size=4)
running = Sequence(list(range(9)), block_size=4)
pool.allocate(running)
computed(pool, running, 9)
sharer = Sequence([*range(8), 99], block_size=4)
assert pool.num_free_blocks == 1 < sharer.num_blocks and pool.can_allocate(sharer)

# en: A fully cached prompt: its 8 tokens are both published blocks of `running`, yet its last block is computed.
# zh: 全部命中缓存的提示词：它的 8 个 token 正是 `running` 已发布的两个块，但它的最后一块仍要计算。
again = Sequence(list(range(8)), block_size=4)
pool.allocate(again)
assert again.num_cached_tokens == 4 and len(again) - again.num_cached_tokens == 4

# en: Stale entries: chapter 03's recipe; C finds only the block that still holds its prefix.
# zh: 过期条目：重现第 03 章的场景；C 只找到仍然存着它的前缀的那一块。
pool = BlockManager(num_blocks=3, block_size=2)
for tokens in ([1, 2, 3, 4, 9], [7, 7, 3, 4]):
    seq = Sequence(tokens, block_size=2)
    pool.allocate(seq)
    computed(pool, seq, len(seq))
    pool.deallocate(seq)
assert pool.prefix_cache.match(Sequence([1, 2, 3, 4, 5], block_size=2)) == [0]

# en: Chunked prefill: a 20-token prompt under a budget of 8 tokens is prefilled 8 tokens at a time.
# zh: 分块 prefill：预算 8 个 token 时，一个 20 个 token 的提示词每次 prefill 8 个 token。
sched = Scheduler(num_kvcache_blocks=8, kvcache_block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
long_prompt = Sequence(list(range(20)), SamplingParams(max_tokens=1), block_size=4)
sched.add(long_prompt)
_, is_prefill = sched.schedule()
assert is_prefill and long_prompt.num_scheduled_tokens == 8 < len(long_prompt)
print(say("the book's side of the second article's five rows holds"))

# %% [markdown] tags=["en"]
# ## Check it
#
# A map that nobody checks goes stale. The cells below keep this one honest, and the test suite
# runs them too (`tests/appendix/test_B_from_nano_vllm.py`):
#
# - `UPSTREAM_NAMES` is upstream's inventory at `bb823b3`: every file, and in each Python file
#   every class, function, method (constructors aside) and field, the fields being what a class
#   body assigns or what a method assigns to `self`. It was read from upstream's source with
#   Python's `ast`; the test suite can compare it with a checkout again.
# - `check_map` reads this very chapter, finds every table, and checks that each name in a
#   *this book* column exists in the package (imported and looked up; a field set on `self` in
#   a method counts, as instances are not built here), that the English and Chinese tables name
#   the same things row by row, and that the upstream columns list exactly the inventory.

# %% [markdown] tags=["zh"]
# ## 验证
#
# 没人检查的对照表迟早会过时。下面的单元让这张表保持可靠，测试套件也会运行它们（`tests/appendix/test_B_from_nano_vllm.py`）：
#
# - `UPSTREAM_NAMES` 是上游在 `bb823b3` 时的清单：每个文件，以及每个 Python 文件中的每个类、函数、方法（构造函数
#   除外）和字段；字段指类体中赋值的名字，以及方法中赋给 `self` 的名字。它是用 Python 的 `ast` 从上游源码读出来的；
#   测试套件可以再拿它与上游的检出副本比较。
# - `check_map` 读取本章自身，找出每一张表，然后检查：*本书*一列中的每个名字都存在于包中（导入后查找；由于这里不
#   构造实例，方法里赋给 `self` 的字段也算存在）；中英文表格逐行列出相同的名字；上游一列恰好列出清单中的全部名字。

# %% upstream inventory
# en: main on 2026-04-26
# zh: 2026-04-26 的 main 分支
UPSTREAM_COMMIT = "bb823b3e06983d71485a8e1f23715ebd87d98ef8"
# en: Upstream files without Python code are listed under the key "".
# zh: 上游中不含 Python 代码的文件列在键 "" 之下。
UPSTREAM_NAMES: dict[str, list[str]] = {
    "": [".gitignore", "LICENSE", "README.md", "assets/logo.png", "pyproject.toml"],
    "bench.py": ["main"],
    "example.py": ["main"],
    "nanovllm/__init__.py": ["LLM", "SamplingParams"],
    "nanovllm/config.py": ["Config", "Config.model", "Config.max_num_batched_tokens", "Config.max_num_seqs",
        "Config.max_model_len", "Config.gpu_memory_utilization", "Config.tensor_parallel_size",
        "Config.enforce_eager", "Config.hf_config", "Config.eos", "Config.kvcache_block_size",
        "Config.num_kvcache_blocks", "Config.__post_init__"],
    "nanovllm/engine/block_manager.py": ["Block", "Block.update", "Block.reset", "Block.block_id",
        "Block.ref_count", "Block.hash", "Block.token_ids", "BlockManager", "BlockManager.compute_hash",
        "BlockManager._allocate_block", "BlockManager._deallocate_block", "BlockManager.can_allocate",
        "BlockManager.allocate", "BlockManager.deallocate", "BlockManager.can_append", "BlockManager.may_append",
        "BlockManager.hash_blocks", "BlockManager.block_size", "BlockManager.blocks",
        "BlockManager.hash_to_block_id", "BlockManager.free_block_ids", "BlockManager.used_block_ids"],
    "nanovllm/engine/llm_engine.py": ["LLMEngine", "LLMEngine.exit", "LLMEngine.add_request", "LLMEngine.step",
        "LLMEngine.is_finished", "LLMEngine.generate", "LLMEngine.ps", "LLMEngine.events",
        "LLMEngine.model_runner", "LLMEngine.tokenizer", "LLMEngine.scheduler"],
    "nanovllm/engine/model_runner.py": ["ModelRunner", "ModelRunner.exit", "ModelRunner.loop",
        "ModelRunner.read_shm", "ModelRunner.write_shm", "ModelRunner.call", "ModelRunner.warmup_model",
        "ModelRunner.allocate_kv_cache", "ModelRunner.prepare_block_tables", "ModelRunner.prepare_prefill",
        "ModelRunner.prepare_decode", "ModelRunner.prepare_sample", "ModelRunner.run_model", "ModelRunner.run",
        "ModelRunner.capture_cudagraph", "ModelRunner.config", "ModelRunner.block_size",
        "ModelRunner.enforce_eager", "ModelRunner.world_size", "ModelRunner.rank", "ModelRunner.event",
        "ModelRunner.model", "ModelRunner.sampler", "ModelRunner.shm", "ModelRunner.kv_cache",
        "ModelRunner.graph_bs", "ModelRunner.graphs", "ModelRunner.graph_pool", "ModelRunner.graph_vars"],
    "nanovllm/engine/scheduler.py": ["Scheduler", "Scheduler.is_finished", "Scheduler.add", "Scheduler.schedule",
        "Scheduler.preempt", "Scheduler.postprocess", "Scheduler.max_num_seqs", "Scheduler.max_num_batched_tokens",
        "Scheduler.eos", "Scheduler.block_size", "Scheduler.block_manager", "Scheduler.waiting",
        "Scheduler.running"],
    "nanovllm/engine/sequence.py": ["SequenceStatus", "SequenceStatus.WAITING", "SequenceStatus.RUNNING",
        "SequenceStatus.FINISHED", "Sequence", "Sequence.block_size", "Sequence.counter", "Sequence.__len__",
        "Sequence.__getitem__", "Sequence.is_finished", "Sequence.num_completion_tokens",
        "Sequence.prompt_token_ids", "Sequence.completion_token_ids", "Sequence.num_blocks",
        "Sequence.last_block_num_tokens", "Sequence.block", "Sequence.append_token", "Sequence.__getstate__",
        "Sequence.__setstate__", "Sequence.seq_id", "Sequence.status", "Sequence.token_ids", "Sequence.last_token",
        "Sequence.num_tokens", "Sequence.num_prompt_tokens", "Sequence.num_cached_tokens",
        "Sequence.num_scheduled_tokens", "Sequence.is_prefill", "Sequence.block_table", "Sequence.temperature",
        "Sequence.max_tokens", "Sequence.ignore_eos"],
    "nanovllm/layers/activation.py": ["SiluAndMul", "SiluAndMul.forward"],
    "nanovllm/layers/attention.py": ["store_kvcache_kernel", "store_kvcache", "Attention", "Attention.forward",
        "Attention.num_heads", "Attention.head_dim", "Attention.scale", "Attention.num_kv_heads",
        "Attention.k_cache", "Attention.v_cache"],
    "nanovllm/layers/embed_head.py": ["VocabParallelEmbedding", "VocabParallelEmbedding.weight_loader",
        "VocabParallelEmbedding.forward", "VocabParallelEmbedding.tp_rank", "VocabParallelEmbedding.tp_size",
        "VocabParallelEmbedding.num_embeddings", "VocabParallelEmbedding.num_embeddings_per_partition",
        "VocabParallelEmbedding.vocab_start_idx", "VocabParallelEmbedding.vocab_end_idx",
        "VocabParallelEmbedding.weight", "ParallelLMHead", "ParallelLMHead.forward"],
    "nanovllm/layers/layernorm.py": ["RMSNorm", "RMSNorm.rms_forward", "RMSNorm.add_rms_forward",
        "RMSNorm.forward", "RMSNorm.eps", "RMSNorm.weight"],
    "nanovllm/layers/linear.py": ["divide", "LinearBase", "LinearBase.forward", "LinearBase.tp_dim",
        "LinearBase.tp_rank", "LinearBase.tp_size", "LinearBase.weight", "LinearBase.bias", "ReplicatedLinear",
        "ReplicatedLinear.weight_loader", "ReplicatedLinear.forward", "ColumnParallelLinear",
        "ColumnParallelLinear.weight_loader", "ColumnParallelLinear.forward", "MergedColumnParallelLinear",
        "MergedColumnParallelLinear.weight_loader", "MergedColumnParallelLinear.output_sizes", "QKVParallelLinear",
        "QKVParallelLinear.weight_loader", "QKVParallelLinear.head_size", "QKVParallelLinear.num_heads",
        "QKVParallelLinear.num_kv_heads", "RowParallelLinear", "RowParallelLinear.weight_loader",
        "RowParallelLinear.forward"],
    "nanovllm/layers/rotary_embedding.py": ["apply_rotary_emb", "RotaryEmbedding", "RotaryEmbedding.forward",
        "RotaryEmbedding.head_size", "RotaryEmbedding.cos_sin_cache", "get_rope"],
    "nanovllm/layers/sampler.py": ["Sampler", "Sampler.forward"],
    "nanovllm/llm.py": ["LLM"],
    "nanovllm/models/qwen3.py": ["Qwen3Attention", "Qwen3Attention.forward", "Qwen3Attention.total_num_heads",
        "Qwen3Attention.num_heads", "Qwen3Attention.total_num_kv_heads", "Qwen3Attention.num_kv_heads",
        "Qwen3Attention.head_dim", "Qwen3Attention.q_size", "Qwen3Attention.kv_size", "Qwen3Attention.scaling",
        "Qwen3Attention.qkv_bias", "Qwen3Attention.qkv_proj", "Qwen3Attention.o_proj", "Qwen3Attention.rotary_emb",
        "Qwen3Attention.attn", "Qwen3Attention.q_norm", "Qwen3Attention.k_norm", "Qwen3MLP", "Qwen3MLP.forward",
        "Qwen3MLP.gate_up_proj", "Qwen3MLP.down_proj", "Qwen3MLP.act_fn", "Qwen3DecoderLayer",
        "Qwen3DecoderLayer.forward", "Qwen3DecoderLayer.self_attn", "Qwen3DecoderLayer.mlp",
        "Qwen3DecoderLayer.input_layernorm", "Qwen3DecoderLayer.post_attention_layernorm", "Qwen3Model",
        "Qwen3Model.forward", "Qwen3Model.embed_tokens", "Qwen3Model.layers", "Qwen3Model.norm",
        "Qwen3ForCausalLM", "Qwen3ForCausalLM.packed_modules_mapping", "Qwen3ForCausalLM.forward",
        "Qwen3ForCausalLM.compute_logits", "Qwen3ForCausalLM.model", "Qwen3ForCausalLM.lm_head"],
    "nanovllm/sampling_params.py": ["SamplingParams", "SamplingParams.temperature", "SamplingParams.max_tokens",
        "SamplingParams.ignore_eos", "SamplingParams.__post_init__"],
    "nanovllm/utils/context.py": ["Context", "Context.is_prefill", "Context.cu_seqlens_q", "Context.cu_seqlens_k",
        "Context.max_seqlen_q", "Context.max_seqlen_k", "Context.slot_mapping", "Context.context_lens",
        "Context.block_tables", "_CONTEXT", "get_context", "set_context", "reset_context"],
    "nanovllm/utils/loader.py": ["default_weight_loader", "load_model"],
}

# %% the map checker
import ast
import functools
import importlib
import inspect
import re
import textwrap
from pathlib import Path

import jupytext

CODE_SPAN = re.compile(r"`([^`]+)`")


def chapter_path(name: str = "B_from_nano_vllm.py") -> Path:
    """This chapter's source file: notebooks/ under the working directory or a folder above it."""
    # zh: 本章的源文件：工作目录或它上面某个文件夹下的 notebooks/ 里。
    for folder in (Path.cwd(), *Path.cwd().parents):
        if (folder / "notebooks" / name).is_file():
            return folder / "notebooks" / name
    raise FileNotFoundError(f"notebooks/{name} is neither under {Path.cwd()} nor under a folder above it")


# en: Once per class: the tables name the fields of the same classes many times, and parsing is the slow part.
# zh: 每个类只算一次：表格多次提到同一些类的字段，而解析是慢的那一步。
@functools.cache
def instance_fields(cls: type) -> frozenset[str]:
    """What a class of ours sets on `self` or registers as a buffer, and its dataclass fields."""
    # zh: 我们的某个类在 `self` 上设置或注册为 buffer 的东西，以及它的 dataclass 字段。
    fields = set(getattr(cls, "__dataclass_fields__", {}))
    for klass in cls.__mro__:
        if not klass.__module__.startswith("nanovllm"):
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(klass)))):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                fields.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("register_buffer", "register_parameter")
                  and node.args and isinstance(node.args[0], ast.Constant)):
                fields.add(node.args[0].value)
    return frozenset(fields)


def lookup(dotted: str) -> bool:
    """True if `dotted` is a module, an attribute reached from one, or an instance field of a class."""
    # zh: `dotted` 是一个模块、从模块出发能取到的属性，或者某个类的实例字段时为 True。
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for position, name in enumerate(parts[cut:], start=cut):
            if hasattr(obj, name):
                obj = getattr(obj, name)
            else:
                last = position == len(parts) - 1
                return last and inspect.isclass(obj) and name in instance_fields(obj)
        return True
    return False


def resolve(ref: str, module: str | None, root: Path) -> bool:
    """A name of ours from a table: relative to the section's module, else to the package root."""
    # zh: 表格里我们的一个名字：相对于这一节的模块，否则相对于包的根。
    if ref.startswith("./"):
        return (root / ref[2:]).exists()
    bases = ([module] if module else []) + ["nanovllm"]
    return any(lookup(f"{base}.{ref}") for base in bases)


def module_of(path: str) -> str:
    """nanovllm/engine/sequence.py -> nanovllm.engine.sequence (a package's __init__ -> the package)."""
    # zh: nanovllm/engine/sequence.py -> nanovllm.engine.sequence（包的 __init__ -> 这个包）。
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def map_rows(source: str) -> dict[str, list[tuple]]:
    """Per language, every table row: (upstream file, our module, upstream names, our names).

    The upstream file is None outside the name tables (where the first column is prose) and ""
    in the table of files without code (where the first column lists files).
    """
    # zh: 按语言列出每一张表格的每一行：（上游文件，我们的模块，上游的名字，我们的名字）。
    # zh:
    # zh: 在名字表格之外（那里第一列是文字），上游文件为 None；在没有代码的文件的表格里
    # zh: （那里第一列列出文件），上游文件为 ""。
    rows: dict[str, list[tuple]] = {"en": [], "zh": []}
    for cell in jupytext.reads(source, fmt="py:percent").cells:
        lang = next((tag for tag in cell.metadata.get("tags", []) if tag in rows), None)
        if cell.cell_type != "markdown" or lang is None:
            continue
        # en: A table's heading is in its own cell
        # zh: 表格的标题单独在一个单元里
        upstream, module = None, None
        for line in cell.source.splitlines():
            if line.startswith("#"):
                spans = CODE_SPAN.findall(line)
                if line.startswith("### ") and len(spans) == 2:
                    upstream, module = spans[0], module_of(spans[1])
                elif line.startswith("### "):
                    upstream, module = "", None
                else:
                    upstream, module = None, None
            elif line.startswith("|") and not set(line) <= set("|-: "):
                columns = [column.strip() for column in line.strip().strip("|").split("|")]
                names = tuple(CODE_SPAN.findall(columns[0])) if upstream is not None else ()
                refs = names if columns[1] == "=" else tuple(CODE_SPAN.findall(columns[1]))
                rows[lang].append((upstream, module, names, refs))
    return rows


def check_map(source: str, root: Path, inventory: dict[str, list[str]]) -> tuple[list[str], dict[str, int]]:
    """Every problem with the map in `source` (empty when it holds), and what was checked."""
    # zh: `source` 中这张对照表的每一个问题（对照表成立时为空），以及检查了哪些东西。
    tables = map_rows(source)
    problems = []
    checked: set[tuple[str | None, str]] = set()
    for lang, rows in tables.items():
        for upstream, module, _, refs in rows:
            for ref in refs:
                checked.add((module, ref))
                if not resolve(ref, module, root):
                    where = f"the table of {upstream}" if upstream else "the table of differences"
                    problems.append(f"{lang}: `{ref}` in {where} is not in this repository")
    if len(tables["en"]) != len(tables["zh"]):
        problems.append(f"the English tables have {len(tables['en'])} rows, the Chinese ones {len(tables['zh'])}")
    for en_row, zh_row in zip(tables["en"], tables["zh"], strict=False):
        if en_row != zh_row:
            problems.append(f"English and Chinese rows differ: {en_row} vs {zh_row}")
            break
    listed = {(upstream, name) for upstream, _, names, _ in tables["en"] if upstream is not None for name in names}
    wanted = {(file, name) for file, names in inventory.items() for name in names}
    problems += [f"upstream's `{name}` ({file or 'a file'}) is missing from the map" for file, name in
                 sorted(wanted - listed)]
    problems += [f"`{name}` is listed for {file or 'the files without code'} but upstream has no such name"
                 for file, name in sorted(listed - wanted)]
    counts = {"upstream names": len(listed), "names of ours": len(checked), "rows per language": len(tables["en"])}
    return problems, counts

# %%
path = chapter_path()
problems, counts = check_map(path.read_text(encoding="utf-8"), path.parent.parent, UPSTREAM_NAMES)
print(say("{upstream} upstream names, {ours} names of ours, {rows} rows per language", upstream=counts["upstream names"],
          ours=counts["names of ours"], rows=counts["rows per language"]))
print(say("upstream files: {files}, problems: {problems}", files=len(UPSTREAM_NAMES) - 1 + len(UPSTREAM_NAMES[""]),
          problems=len(problems)))
for problem in problems:
    print(" ", problem)
assert problems == []
assert counts["upstream names"] == sum(len(names) for names in UPSTREAM_NAMES.values())

# %% [markdown] tags=["en"]
# Three rows of the tables are claims about numbers, so they are checked here too: the block
# hashes are byte-for-byte upstream's (a prefix cache could be shared between the two);
# upstream's graph sizes leave the largest batches without a graph when `max_num_seqs` is not
# a multiple of 16, where ours capture that size as well; and RMSNorm after a residual, in
# bf16, returns the same residual as upstream's arithmetic and a normalized output that differs
# in its last bits.

# %% [markdown] tags=["zh"]
# 表中有三行是关于数值的论断，所以也在这里检查：块哈希与上游的逐字节相同（两者的前缀缓存可以互通）；当
# `max_num_seqs` 不是 16 的倍数时，上游的图档位让最大的几种批次没有图可用，而我们把这个批大小本身也捕获了；
# 加上残差之后的 RMSNorm 在 bf16 下返回的残差与按上游算法算出的相同，归一化的输出则在最后几位上有差别。

# %%
import numpy as np
import torch
import xxhash

from nanovllm.engine.cuda_graphs import capture_sizes, graph_batch_size
from nanovllm.engine.prefix_cache import NO_HASH, block_hash
from nanovllm.layers.layernorm import rms_norm


def upstream_digest(token_ids: list[int], parent: int = NO_HASH) -> int:
    """The bytes upstream's `compute_hash` digests: the parent's 8 bytes, then the ids as NumPy int64."""
    # zh: 上游的 `compute_hash` 摘要的字节：父块的 8 个字节，然后是作为 NumPy int64 的各 id。
    prefix = parent.to_bytes(8, "little") if parent != NO_HASH else b""
    return xxhash.xxh64(prefix + np.asarray(token_ids, dtype=np.int64).tobytes()).intdigest()


parent = NO_HASH
for block in ([1, 2, 3, 4], [151_643, 0, 7, 99_999], [5, 5, 5, 5]):
    ours = block_hash(block, parent)
    assert ours == upstream_digest(block, parent)
    parent = ours
print(say("three chained block hashes equal upstream's; the last is {last:#018x}", last=parent))

# en: max_num_seqs=100
# zh: max_num_seqs=100 时
upstream_sizes = [1, 2, 4, 8, *range(16, 100 + 1, 16)]
uncovered = [batch for batch in range(1, 101) if batch > max(upstream_sizes)]
print(say("max_num_seqs=100: upstream has no graph for batches {first}-{last}; ours replays {ours} for them",
          first=uncovered[0], last=uncovered[-1], ours=graph_batch_size(uncovered[-1], capture_sizes(100))))
assert uncovered == [97, 98, 99, 100] and all(graph_batch_size(b, capture_sizes(100)) == 100 for b in uncovered)


def upstream_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's arithmetic: the sum in float32, normalized before it is rounded to the model's dtype."""
    # zh: 上游的算法：用 float32 求和，先归一化，再舍入到模型的 dtype。
    total = x.float() + residual.float()
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight, total.to(x.dtype)


norm_rng = torch.Generator().manual_seed(0)
x, residual = (torch.randn(64, 256, generator=norm_rng).to(torch.bfloat16) for _ in range(2))
weight = (torch.rand(256, generator=norm_rng) + 0.5).to(torch.bfloat16)
(ours_out, ours_sum), (their_out, their_sum) = rms_norm(x, residual, weight, 1e-6), upstream_add_rms_norm(
    x, residual, weight, 1e-6)
# en: Distance in units of the last place: adjacent bf16 values of one sign differ by 1 as 16-bit integers.
# zh: 以最后一位为单位的距离：同号的相邻 bf16 数值，作为 16 位整数相差 1。
last_places = (ours_out.view(torch.int16).int() - their_out.view(torch.int16).int()).abs()
print(say("RMSNorm in bf16: the same residual: {same}; outputs differ in {share:.0%} of the elements, by at most {ulps} "
          "units in the last place", same=torch.equal(ours_sum, their_sum), share=(last_places > 0).float().mean(),
          ulps=last_places.max()))
assert torch.equal(ours_sum, their_sum) and 0 < last_places.max() <= 2

# %% [markdown] tags=["en"]
# ## What this appendix gives you
#
# - A name-by-name map from upstream nano-vllm (`bb823b3`) to this book, with chapters, checked
#   against the package every time the book is built.
# - The behavioural differences in one table, each with its reason and the code where it lives.
# - The five places where the upstream that the second article quotes (`df99418` to the merges of
#   2026-04-13, before chunked prefill) differs from `bb823b3` and from this book, each with the
#   upstream commit that changed it, and checked on the book's side.
#
# If you find an upstream name this map misses, or a name of ours it gets wrong, the check above
# fails: add the row in both languages.

# %% [markdown] tags=["zh"]
# ## 本附录小结
#
# - 从上游 nano-vllm（`bb823b3`）到本书的逐名对照表，附有章节，每次构建本书时都会与包中的代码核对。
# - 一张表列出全部行为差异，每一处都给出原因和所在的代码。
# - 第二篇文章所引用的上游（`df99418` 到 2026-04-13 的合并之前，分块 prefill 之前）与 `bb823b3`、与本书不同的
#   五处，每一处都注明了上游做出改动的提交，并在本书这一侧做了检查。
#
# 如果你发现这张表漏掉了上游的某个名字，或者写错了本书的某个名字，上面的检查就会失败：请用两种语言补上这一行。
