"""What a rank records about itself while it runs: the event ring (``tracer``) and its Perfetto
export (``perfetto``)."""
