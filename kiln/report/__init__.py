"""HTML reports: the chart module every report draws with (charts) and the training-run page (run_page)."""
