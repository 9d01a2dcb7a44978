"""Per-model request boundaries shared by the HTTP routes and the command line: text in, model-ready ids
to the engine, text out."""
