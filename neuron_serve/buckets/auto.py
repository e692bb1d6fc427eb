"""What every ``auto`` bucket list shares, whatever the model's kind (a generate model's ``prefill_buckets`` and
``decode_batch_buckets``, a pooling model's ``length_buckets``, a task: infer model's ``batch_sizes``): how many
recorded calls a replica waits for before it starts on the buckets they call for, and between two looks while it
serves, unless the model.yaml's ``learn_buckets_after`` says."""

AUTO_LEARN_AFTER = 1000  # recorded calls before a family's buckets: auto start on the buckets they call for
