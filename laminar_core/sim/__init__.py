"""The simulator: a virtual clock (``clock``), simulated engines and transport (``rollout``,
``trainer``, ``transport``, their options in ``config``), output-length and tool-call models
(``lengths``, ``tools``), and the studies that run the real loop on them (``study``).

A package (not a namespace) so the import contracts (``lint-imports``) see it as a layer."""
