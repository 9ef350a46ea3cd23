"""The run-folder contract, torch-free: the files of ``log.root/name`` and their records
(``folder``), the one-job lease (``lease``), checkpoint folders as files
(``checkpoint_files``), atomic writes (``atomic``) and file digests (``file_hash``).
Training writes a run folder; launch, repro, analysis and convert read it through this
package."""
