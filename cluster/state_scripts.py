"""The Lua scripts that make each change of a request's state in Redis one atomic step, over
the key schema of cluster/state.py: a token write (fenced by attempt, deduplicated by
offset), an attempt's start, a record's creation and voiding, a claim of an orphan, the
tenants' changes and a lease."""

# KEYS: hash, tokens, active, failures. ARGV: attempt, offset, ttl, final state ('' = none),
# finish_reason, error, request id, now, status, n, n failure causes, then the token ids.
# Returns {result, log length}.
APPEND_SCRIPT = """
local raw = redis.call('HGET', KEYS[1], 'attempt')
if not raw then return {'missing', 0} end
local a, mine = tonumber(raw), tonumber(ARGV[1])
if a > mine then return {'fenced', 0} end
if a < mine then redis.call('HSET', KEYS[1], 'attempt', ARGV[1]) end
local n = redis.call('LLEN', KEYS[2])
local off = tonumber(ARGV[2])
if off > n then return {'gap', n} end
local nf = tonumber(ARGV[10])
local i = 11 + nf + (n - off)
while i <= #ARGV do
  local j = math.min(i + 999, #ARGV)
  redis.call('RPUSH', KEYS[2], unpack(ARGV, i, j))
  i = j + 1
end
n = redis.call('LLEN', KEYS[2])
if ARGV[4] ~= '' then
  local cur = redis.call('HGET', KEYS[1], 'state')
  if cur ~= 'FINISHED' and cur ~= 'FAILED' and cur ~= 'CANCELLED' then
    redis.call('HSET', KEYS[1], 'state', ARGV[4], 'finish_reason', ARGV[5], 'error', ARGV[6],
               'updated', ARGV[8], 'status', ARGV[9])
  end
  if nf > 0 then
    redis.call('DEL', KEYS[4])
    redis.call('RPUSH', KEYS[4], unpack(ARGV, 11, 10 + nf))
  end
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
  redis.call('EXPIRE', KEYS[4], ARGV[3])
  redis.call('SREM', KEYS[3], ARGV[7])
end
return {'ok', n}
"""

# KEYS: hash, failures. ARGV: attempt, owner, prefill, decode, failure, now.
BEGIN_SCRIPT = """
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return 'missing' end
if st == 'FINISHED' or st == 'FAILED' or st == 'CANCELLED' then return 'ended' end
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= '' and owner ~= ARGV[2] then return 'not_owner' end
if tonumber(redis.call('HGET', KEYS[1], 'attempt') or '0') > tonumber(ARGV[1]) then
  return 'stale'
end
redis.call('HSET', KEYS[1], 'attempt', ARGV[1], 'owner', ARGV[2], 'prefill', ARGV[3],
           'decode', ARGV[4], 'state', 'RUNNING', 'updated', ARGV[6])
if ARGV[5] ~= '' then redis.call('RPUSH', KEYS[2], ARGV[5]) end
return 'ok'
"""

# KEYS: hash, active. ARGV: request id, then field/value pairs. Creates only if absent.
CREATE_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2, #ARGV))
local st = redis.call('HGET', KEYS[1], 'state')
if st ~= 'FINISHED' and st ~= 'FAILED' and st ~= 'CANCELLED' then
  redis.call('SADD', KEYS[2], ARGV[1])
end
return 1
"""

# KEYS: hash, active set. ARGV: request id, create nonce, status, error, now, ttl.
# A create the router gave up on may land later: end it if it did (that very create, by its
# nonce, not a later one under the same id), and nothing has begun on it.
VOID_SCRIPT = """
if redis.call('HGET', KEYS[1], 'state') ~= 'QUEUED' then return 0 end
if redis.call('HGET', KEYS[1], 'nonce') ~= ARGV[2] then return 0 end
if redis.call('HGET', KEYS[1], 'attempt') ~= '0' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'FAILED', 'status', ARGV[3], 'error', ARGV[4],
           'updated', ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('SREM', KEYS[2], ARGV[1])
return 1
"""

# KEYS: hash. ARGV: old owner, new owner.
CLAIM_SCRIPT = """
local st = redis.call('HGET', KEYS[1], 'state')
if not st or st == 'FINISHED' or st == 'FAILED' or st == 'CANCELLED' then return 0 end
if (redis.call('HGET', KEYS[1], 'owner') or '') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'owner', ARGV[2])
return 1
"""

# KEYS: hash. ARGV: attempt. Raises the stored attempt to ARGV[1] if it is lower.
RAISE_SCRIPT = """
local a = redis.call('HGET', KEYS[1], 'attempt')
if a and tonumber(a) < tonumber(ARGV[1]) then redis.call('HSET', KEYS[1], 'attempt', ARGV[1]) end
return 1
"""

# KEYS: the tenants' overrides (a hash: tenant -> JSON of its fields), their version. ARGV:
# the tenants to reset (JSON list), then the changes (JSON: tenant -> fields), merged field by
# field into what is there. Returns the new version.
TENANTS_SCRIPT = """
for _, t in ipairs(cjson.decode(ARGV[1])) do redis.call('HDEL', KEYS[1], t) end
for t, fields in pairs(cjson.decode(ARGV[2])) do
  local old = redis.call('HGET', KEYS[1], t)
  local merged = old and cjson.decode(old) or {}
  for k, v in pairs(fields) do merged[k] = v end
  redis.call('HSET', KEYS[1], t, cjson.encode(merged))
end
return redis.call('INCR', KEYS[2])
"""

# KEYS: lease. ARGV: holder, ttl ms.
LEASE_SCRIPT = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
