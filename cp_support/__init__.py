"""What the examples, benchmarks and tests share, and the library does not ship (not installed).

| module      | what                                                                              |
|-------------|-----------------------------------------------------------------------------------|
| `launch`    | `run_ranks`: a function on n fresh gloo processes with a time limit; `RANK_ENV`    |
| `memory`    | the process's resident-set high-water mark, resettable                            |
| `traffic`   | byte counters at the c10d calls (`PayloadCounter`) and on the wire                |
| `allgather` | the baseline CP transport that all-gathers K and V in every attention layer      |
| `minima`    | the analytic bytes a rank must receive (DeepSeek Sparse Attention layers)          |

Examples, benchmarks and tests import this package and the library; benchmarks never import an
example, tests never a benchmark's internals or another test.
"""
