"""headroom where users train without writing the loop: a callback for transformers' ``Trainer``
(:mod:`headroom.integrations.transformers`). Each module imports its trainer only when imported
itself (``pip install headroom[transformers]``)."""
