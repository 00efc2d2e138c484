"""Which errors with_commit_retries takes for a lost commit race (lake.commits.is_commit_conflict):
Iceberg's messages as a JVM stack and as Spark Connect prints them."""

from cdc_lakehouse.lake.commits import is_commit_conflict

# As seen in a Spark Connect client (pyspark 4.1), from two quarantine MERGEs at once (#51).
CONNECT = (
    "(org.apache.iceberg.exceptions.ValidationException) Found conflicting files that can contain records "
    'matching ref(name="table_name") == "qr_1": [file:/w/cdc_meta/quarantine/data/x.parquet]'
)


def test_row_level_validation_failures_are_conflicts_in_both_forms():
    assert is_commit_conflict(Exception(CONNECT))
    assert is_commit_conflict(Exception(CONNECT.replace("ValidationException) ", "ValidationException: ")))
    assert is_commit_conflict(Exception("ValidationException: Found new conflicting delete files that can apply"))
    assert is_commit_conflict(Exception("ValidationException: Found conflicting deleted files that can contain"))


def test_other_errors_are_not_conflicts():
    assert not is_commit_conflict(Exception("[INTERNAL_ERROR_ATTRIBUTE_NOT_FOUND] Could not find table_name#2933"))
    assert not is_commit_conflict(Exception("ValidationException: Cannot find field 'x'"))
    assert not is_commit_conflict(Exception("Found conflicting attributes a#1 in the condition joining outer plan"))
