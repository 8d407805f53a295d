"""See checkpoints: a read-only local web page (``checkpoint-store ui``) and plots.

The page and ``checkpoint-store plot`` read a storage location through the
library's own readers (:class:`~checkpoint_store.storage.StorageContext`,
:class:`~checkpoint_store.checkpoint.Checkpoint`,
:func:`~checkpoint_store.retention.select_kept`) in :mod:`checkpoint_store.ui._model`;
the web server is :mod:`checkpoint_store.ui._server` (Flask), the charts are
Chart.js (shipped in ``static/``) in the browser and matplotlib for images.
Their dependencies come with the ``[ui]`` extra; importing this package
imports none of them.
"""
