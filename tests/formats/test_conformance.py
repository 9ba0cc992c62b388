"""Every shard format passes the shared conformance suite."""

from fastload.testing.formats import ShardFormatTests


class TestWebDatasetConformance(ShardFormatTests):
    format_name = "webdataset"


class TestTFRecordConformance(ShardFormatTests):
    format_name = "tfrecord"


class TestLMDBConformance(ShardFormatTests):
    format_name = "lmdb"
