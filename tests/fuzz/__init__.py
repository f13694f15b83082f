"""The fuzz session (``nox -s fuzz``; issue 14, item 5): the wire decoders, the live
listeners and the bootstrap service under generated hostile input. ``-k short`` runs the
quick variants (about half a minute in all)."""
