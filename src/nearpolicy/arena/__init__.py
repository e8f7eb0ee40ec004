"""The correction arena (`nearpolicy arena ARENA.toml`): a grid of ordinary training runs from one base config,
corrections x mismatch sources x seeds, run one after another with the same data order (per seed), budget and eval,
resumable cell by cell, and one table of how each correction ended under each source.

  spec.py    the ARENA.toml file: parse, validate, expand into cells (each an ordinary validated Config)
  state.py   OUT/arena-state.json: what each cell did, written atomically; a changed arena is refused
  runner.py  runs the cells through the training API (api.run_training), the progress line and its ETA
  records.py a cell attempt's record in the state (classify, start / finish) and the time estimates
  worker_child.py the child process of --workers: runs one cell, reports on its result pipe
  workers.py `--workers N`: up to N cells at a time, each in a child process; the parent keeps the state
  table.py   per-cell results from each run's metrics.jsonl (runs.folder.read_metrics), aggregates over seeds
  outcomes.py the run-averaged outcomes of a cell: the eval AUC (per problem too) and the late training reward
  paired.py  pure paired statistics: the paired t over seeds, the eval set's noise floor, the problems x seeds
             bootstrap, the minimum detectable difference
  comparisons.py which arms are compared (corrections vs the baseline, sources vs the first) and each comparison
  sequential.py the sequential stopping rule (arena.sequential): looks after each seed, Bonferroni over looks
  page.py    OUT/arena.md, arena.json and a self-contained arena.html with plots

docs/arena.md describes the file format, the shipped configs/arena.toml and its sizes."""
