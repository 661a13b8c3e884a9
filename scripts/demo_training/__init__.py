"""The pieces of ``scripts/train_demo_model.py``, which builds colibri's demo model.

``repo`` the repository paths and colibri's pure-Python modules loaded from their files,
``config`` the fixed recipe (seed, special tokens, the ``Glm4MoeForCausalLM`` config),
``tokenizer`` the BPE tokenizer trained on the synthetic corpus, ``batches`` the encoded
conversations and their batches (what the loss is taken on), ``weights`` the model's
construction, initial weights and checkpoints, ``training`` the training loop, ``evaluation``
the checks after training (a greedy HF sanity pass, conversion and the engine's evaluation),
``report`` the model card and the loss plot. torch and transformers are imported inside the
functions that need them, so the data path runs without them.
"""
