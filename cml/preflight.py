"""CML session task, after the install: what this runtime lacks for the jobs, one line each with its fix.

The same check as `textsql preflight`, with the project's TEXTSQL_<NAME> values. Only what notebook 01
needs (it runs next, during the import) can fail the import; what training needs later (pdsh, sshd,
GPUs) is reported and left to the user, who starts the training job once the runtime has it.
"""

from textsql.cli import cli

cli.main(["preflight", "--require", "prepare"], prog_name="textsql")
