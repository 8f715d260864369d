"""Stock Flower FedAvg + plain Opacus DP-SGD: the baseline of ``benchmarks/simulation.py``.

Laid out as Flower's ``examples/opacus``: ``task.py`` holds the work and never imports
Flower; ``client_app.py`` and ``server_app.py`` are thin. The work is fedsparse's, taken from
``fedsparse.common`` so that both apps do the same thing per round: the digits CNN, the same
partitions, the same Poisson-sampled batches (the same seed streams), one ``local-epochs``
pass of DP-SGD with a fixed noise multiplier, and the server's evaluation of each new model on
the held-out test split. What differs is what the comparison is about: Flower's own
``FedAvg`` and ``ArrayRecord`` messages of the dense model, and Opacus's ``PrivacyEngine``
instead of fedsparse's sparse engine, payloads, records and checkpoints.
"""
