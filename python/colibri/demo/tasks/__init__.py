"""The tables of the demo model's tasks: phrasings, answers, traces, and what is held out of each.

``capitals`` the country/capital lookups, ``arithmetic`` the 2-digit sums (and the held-out
pairs), ``cities`` the real and generated city names (training's and the evaluation's),
``tools`` the three demo tools with their requests, results and answers, ``chat`` small talk,
the memory task and the system prompts. Pure Python, no package imports outside ``demo``;
:mod:`colibri.demo.data` builds the training conversations from them and
:mod:`colibri.demo.eval_items` the evaluation's prompts.
"""
