"""Course plumbing: the real sample data, the quizzes, the exercise grader and the command line."""
