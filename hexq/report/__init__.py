"""`hexq report` (hexq.report.page.write_report): one artifact, and the benchmark results of its model family, as
an HTML page of PNG plots.

    DIR/index.html        header (model, size, bits, budget, checksums), one section per plot, tables of numbers
    DIR/hotness.png       routed-token share per layer x expert, fast-tier experts marked
    DIR/loss_tables.png   MSE vs bits of every expert, one panel per layer
    DIR/allocation.png    the artifact's width per layer x expert
    DIR/hit_rates.png     fast-tier hit rate per layer of placement schemes 1/2/3 at K = 25% and 50% of the experts
    DIR/frontier.png      perplexity vs bits: hexq mixed / uniform / importance-blind, hexq GPTQ, llmcompressor

Plots 1-4 come from the artifact alone (stats.safetensors and the manifest). Plot 4 adds held-out hit rates and
plot 5 is drawn from the JSON files the benchmarks write; a missing or non-matching file turns into a note on the
page naming the file and the command that writes it, never an error.

Modules: numbers (the page model, the result files read, the numbers computed), plots (the PNGs), page (sections,
HTML, writing).

The same inputs give the same bytes: fixed figure sizes and dpi, matplotlib's default style whatever the user's
matplotlibrc says, no software or date stamps in the PNGs, nothing time-dependent in the HTML. The folder is
written through hexq.base.outputs: into a hidden sibling renamed to DIR once every file is there, so DIR never holds
half a report; an existing DIR is replaced only with force and only when it is a report hexq wrote, and DIR may not be,
hold or lie inside the artifact or the result files being read.
"""
