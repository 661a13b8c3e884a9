"""The models colibri brings with it, and the demo model's data and evaluation.

``builtin`` locates the default model (the trained demo model shipped in ``model/``, id
``colibri-demo``; its card is ``model/CARD.md``) and builds the tests' random GLM-4.5-MoE
checkpoint (id ``colibri-builtin``) on first use; ``data`` holds the synthetic tasks the demo model
is trained and evaluated on (``scripts/train_demo_model.py`` trains it): the training
conversations, built from the task tables in ``tasks/``, the names strung from tokenizer pieces
(``name_pieces``) and the held-out prompts (``eval_items``); ``preamble`` the long coding-agent
preambles for its long-context training and evaluation, and ``eval`` the evaluation through the
real engine (``python -m colibri.demo.eval``, ``colibri eval-demo``).

The data and preamble modules are pure Python and import each other relatively, never
``colibri`` outside this directory: the training script loads the directory as a package of its
own, without the compiled engine.
"""
