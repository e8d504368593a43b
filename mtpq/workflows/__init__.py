"""Whole jobs built from the libraries, between them and the commands (cli) and builds (release) that run them:
convert-and-quantize in one pass (:mod:`.convert_quantize`), ``--mtp-type auto``'s measured head choice
(:mod:`.auto_head`), a head sweep on one trunk (:mod:`.headsweep`) and a build's measuring and gating
(:mod:`.gates`). A workflow imports the libraries (convert, quantize, runtime, engines, acceptance, ...), never cli
or release; the libraries never import a workflow."""
