"""The machinery the chunked engines (``fpdt``, ``seco``, ``spaco``) share: the state of one
chunked step (:mod:`.run`), its settings (:mod:`.settings`) and the byte formulas plans
and runs both read (:mod:`.costs`)."""
