"""Offline training tools: EAGLE and Medusa draft heads self-distilled from their target.

- `distill`: prompts, the target's greedy continuations and its features (the data).
- `objectives`: each head's training rows, loss and validation accuracy.
- `draft_heads`: the optimiser loop (`train_heads`) and the whole run (`train_draft`).

Not part of the runtime: the engine never imports this package; `pagedinfer train-draft`
imports `draft_heads` lazily. The heads it writes are loaded by `spec_decode.heads`.
"""
