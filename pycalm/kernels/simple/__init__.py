"""The simple tier: one plain kernel per op, what a learner reads first.

Each module is a docstring (the math, the thread mapping, the bytes moved, the reference in
pycalm.cpu.reference it matches), one `@cuda.jit` kernel and its launcher, in under about 60
lines. `EngineOptions(kernels="simple")` runs the whole engine on them (pycalm.gpu.simple wires
them, one launch a line, like llama2.c's forward()). In the order a token meets them:

    decode       W[r, c] as float32, one function a format
    embed        x = tok_embeddings[token]            a thread a column
    rmsnorm      xb = x / sqrt(mean(x^2) + eps) * w   a block a row
    matvec       y = W x                              a warp a row
    matmul       Y = X W^T (the prompt's rows)        a warp a 16x8 tile, one mma
    rope_kv      q, k rotated; cache row pos = k, v   a thread a pair of columns
    attention    softmax(q k^T / sqrt(head_dim)) v    a block a head
    elementwise  h = silu(a) * b; x += y              a thread an element
    argmax       token = argmax(logits)               one block

(The step's end, `advance`, is pycalm.kernels.step's one-thread kernel, already plain.)

docs/READING.md walks them, then what each fast kernel (pycalm/kernels/*.py) adds.
"""
