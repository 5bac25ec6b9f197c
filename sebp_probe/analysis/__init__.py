"""Analysis: gradient statistics (hooks), inactive rows by cause (causes), knee, eps and N (knee), the report
(report), the analysis itself (analyze) and its pictures (heatmap, plots)."""
