"""HTML reports: the chart module every report draws with (charts), a run's metrics.jsonl read back
(run_metrics) and the training-run page (run_page) with its loader-bench sections (loader_bench)."""
