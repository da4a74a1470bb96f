-- celery-caps history: the events recorded at or after a time, oldest first.
--
-- KEYS: history
-- ARGV: since (epoch seconds)
-- Returns the event documents.

return redis.call('ZRANGEBYSCORE', KEYS[1], score_text(tonumber(ARGV[1])), '+inf')
