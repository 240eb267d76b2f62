"""hexq's command line: a thin Typer layer over the library."""
