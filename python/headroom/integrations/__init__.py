"""headroom where users train without writing the loop: a callback for transformers' ``Trainer``
(:mod:`headroom.integrations.transformers`) and one for Lightning's
(:mod:`headroom.integrations.lightning`). Each module imports its trainer only when imported itself
(``pip install headroom[transformers]``, ``headroom[lightning]``)."""
