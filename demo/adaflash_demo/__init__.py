"""adaflash-demo: the demo world and the benchmark harness of adaflash-hf, kept out of the library's wheel.

`adaflash_demo.world` builds and loads the offline demo world; `adaflash_demo.bench` measures every decoding method
on it. The library (`adaflash_hf`) never imports this package, except for its `adaflash demo` and `adaflash bench`
command-line verbs (and `adaflash online` without --target), which name `pip install ./demo` when it is missing.
"""
